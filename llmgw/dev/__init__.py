"""dev: see the modules of this package."""
