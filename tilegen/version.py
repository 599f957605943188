"""tilegen's version, in a module of its own: what names caches, generated modules and database rows
can read it without importing the package, whose ``__init__`` imports every op."""

__version__ = "0.1.0"
