"""The version of ckpttool, in one place: the package, the CLI and the journal's plan id read it."""

__version__ = "0.1.0"
