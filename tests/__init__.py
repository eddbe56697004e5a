"""The test suite. Every folder is a package, so helpers import as ``tests.<area>.<module>``."""
