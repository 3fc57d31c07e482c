"""Command-line entry point of the Astrolabe distribution (``astrolabe <subcommand>``).

This package dispatches (each subcommand lives in the package that owns it) and holds the few leaf modules every
service shares: ``lifecycle`` (signals, heap), ``tracing`` (OpenTelemetry set-up) and ``envoy`` (the launcher).
"""
