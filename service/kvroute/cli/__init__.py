"""The ``kvroute`` command line; the entry point is ``kvroute.cli.main:main``."""
