"""net: see the modules of this package."""
