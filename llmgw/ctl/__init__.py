"""ctl: see the modules of this package."""
