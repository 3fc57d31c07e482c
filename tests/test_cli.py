"""astrolabe.cli: the top-level help names every command, and every option of every command explains itself.

The parsers are taken from the commands themselves: each command's ``main(["--help"])`` runs with
``ArgumentParser.parse_known_args`` replaced by one that hands the parser back, so a command added to
``SUBCOMMANDS`` (or to a nested table) is walked without this test knowing it.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

import pytest

from astrolabe.cli import NESTED, SUBCOMMANDS, main
from bench.cli import BENCHMARKS

DEFAULT_NOT_STATED_OK: set[str] = set()
"""Commands whose options may leave their default unsaid (none)."""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``module.main`` builds, before it parses anything."""
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        with pytest.raises(_Captured) as captured:
            importlib.import_module(module).main(["--help"])
    return captured.value.parser


def _walk(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand parser below it, each with its command line (``predictor serve``)."""
    yield path, parser
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")


def _commands() -> list[tuple[str, str]]:
    """(command line, module) of every command that parses its own arguments."""
    commands = [(f"bench {name}", module) for name, (module, _) in BENCHMARKS.items()]
    return [(name, module) for name, (module, _) in SUBCOMMANDS.items() if name != "bench"] + commands


def _all_parsers(monkeypatch) -> list[tuple[str, argparse.ArgumentParser]]:
    return [walked for command, module in _commands() for walked in _walk(_parser_of(module, monkeypatch), command)]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions  # noqa: SLF001
            if a.option_strings and not isinstance(a, argparse._HelpAction)]  # noqa: SLF001


def test_top_level_help_names_every_command_and_every_nested_one(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in out, name
    assert set(NESTED) <= set(SUBCOMMANDS)
    for name in NESTED:
        for sub in importlib.import_module(SUBCOMMANDS[name][0]).COMMANDS:
            assert f"\n    {name} {sub} " in out, (name, sub)
    for bench in BENCHMARKS:
        assert f"astrolabe bench {bench}" in out or f"    bench {bench} " in out


def test_bench_help_names_every_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for bench in BENCHMARKS:
        assert f"\n  {bench} " in out, bench


def test_nested_tables_name_the_parsers_subcommands(monkeypatch):
    for name in ("predictor", "tagger"):
        module = SUBCOMMANDS[name][0]
        listed = set(importlib.import_module(module).COMMANDS)
        walked = {path.split(" ", 1)[1] for path, _ in _walk(_parser_of(module, monkeypatch), name) if " " in path}
        assert listed == walked, name
    assert set(importlib.import_module("bench.cli").COMMANDS) == set(BENCHMARKS)


def test_every_option_of_every_command_has_help_that_states_its_default(monkeypatch):
    missing_help, default_unsaid = [], []
    parsers = _all_parsers(monkeypatch)
    assert {path for path, _ in parsers} >= {"extproc", "emulator", "predictor serve", "predictor profile",
                                             "predictor fit", "tagger serve", "bench tracing", "demo"}
    for path, parser in parsers:
        formatter = parser._get_formatter()  # noqa: SLF001
        for action in _options(parser):
            name = f"{path} {action.option_strings[-1]}"
            if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
                missing_help.append(name)
                continue
            takes_value = action.nargs != 0
            if (takes_value and not action.required and path.split()[0] not in DEFAULT_NOT_STATED_OK
                    and "default" not in formatter._expand_help(action)):  # noqa: SLF001
                default_unsaid.append(name)
    assert missing_help == []
    assert default_unsaid == []


def test_a_default_of_true_never_reads_backwards(monkeypatch):
    """A flag that turns something off shows the pair's name in force, never ``(default: True)``."""
    for path, parser in _all_parsers(monkeypatch):
        help_text = parser.format_help()
        assert "(default: True)" not in help_text, path
        formatter = parser._get_formatter()  # noqa: SLF001
        for action in _options(parser):
            if isinstance(action, argparse.BooleanOptionalAction):
                expected = action.option_strings[0] if action.default else action.option_strings[-1]
                assert f"(default: {expected})" in formatter._expand_help(action), (path, action.dest)  # noqa: SLF001


def test_every_default_is_printed_once(monkeypatch):
    for path, parser in _all_parsers(monkeypatch):
        formatter = parser._get_formatter()  # noqa: SLF001
        for action in _options(parser):
            assert formatter._expand_help(action).count("default") <= 1, (path, action.option_strings)  # noqa: SLF001


def test_an_uninstalled_propagator_is_refused_with_a_message(monkeypatch, capsys):
    """OpenTelemetry's import raises a bare ValueError for an unknown OTEL_PROPAGATORS entry (e.g. b3 without its
    package), which would crash every service with a traceback; the CLI says so and exits 2 instead."""
    from astrolabe.cli import main

    monkeypatch.setenv("OTEL_PROPAGATORS", "tracecontext,b3")
    assert main(["emulator", "--port", "1"]) == 2
    assert "b3" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_PROPAGATORS", "tracecontext,baggage")
    from astrolabe.cli import _propagators_problem

    assert _propagators_problem("tracecontext,baggage") is None and _propagators_problem("none") is None
