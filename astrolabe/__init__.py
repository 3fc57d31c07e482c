"""Command-line entry point of the Astrolabe distribution (``astrolabe <subcommand>``).

This package only dispatches; each subcommand lives in the package that owns it.
"""
