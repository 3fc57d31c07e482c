"""`astrolabe bench <name>`: one benchmark per module, each with its own `main(argv) -> int` and parser.

Importing this module loads no benchmark; the chosen one is imported on dispatch.
"""

from __future__ import annotations

import importlib
import sys

# benchmark name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "tagger": ("bench.tagger_bench", "per-request latency of both length taggers at 1 and 16 concurrent"),
    "predictor": ("bench.predictor_bench", "latency of one prediction (predictor.sim.predict) versus instance size"),
}


def _usage() -> str:
    lines = ["usage: astrolabe bench <name> [options]", "", "benchmarks:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Dispatch `argv` to a benchmark; returns its exit status (2 on an unknown name or none)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"astrolabe bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    return int(module.main(rest) or 0)
