"""node: see the modules of this package."""
