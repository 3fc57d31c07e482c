"""`astrolabe predictor <sub>`: the predictor sidecar (`serve`) and its tools (`fit`).

`serve --backend HOST:PORT --listen HOST:PORT ...` runs the sidecar beside one backend (`predictor.server`).

`fit PROFILE.csv --model NAME -o COEFFS.json` fits `LinearBatchTimeModel` on the fixed training split of the
profile's rows for one model shape (`predictor.sim.batch_time.split_holdout`: 1 shape in 5 of each kind held
out), prints the mean absolute percentage error (MAPE) on the held-out shapes, overall and per kind, and writes
the coefficients in the format of the shipped JSON files (`LinearBatchTimeModel.to_json`).

`profile --backend HOST:PORT -o PROFILE.csv [--fit COEFFS.json]` drives a live vLLM server with controlled batches,
measures its iteration times from its own metrics (`predictor.profile`), writes them as a profile CSV and, with
``--fit``, fits the coefficients on all measured rows (constrained to be >= 0, `predictor.profile.fit_nonnegative`)
and prints the fit's MAPE on them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from astrolabe.cli import HelpFormatter
from astrolabe.logs import add_arguments as add_log_arguments, setup_logging

logger = logging.getLogger(__name__)

COMMANDS: dict[str, str] = {
    "serve": "run the predictor sidecar beside one backend",
    "fit": "fit the batch-time model on a profile CSV; print held-out MAPE",
    "profile": "measure a live vLLM backend's iteration times; write a CSV (and fit it)",
}
"""Subcommand -> one-line help (also listed by ``astrolabe --help``)."""


def _cmd_fit(args: argparse.Namespace) -> int:
    from predictor.sim.batch_time import fit_linear, load_profile, mape, split_holdout

    try:
        rows = load_profile(args.profile, args.model)
        train, heldout = split_holdout(rows)
        model = fit_linear(train)
    except (OSError, ValueError) as exc:
        print(f"astrolabe predictor fit: {exc}", file=sys.stderr)
        return 1
    print(f"model {args.model}: {len(rows)} shapes, fitted on {len(train)}, held out {len(heldout)}")
    print(f"  train MAPE            {100 * mape(model, train):6.2f}%")
    print(f"  held-out MAPE overall {100 * mape(model, heldout):6.2f}%")
    for kind in dict.fromkeys(r.kind for r in heldout):
        kind_rows = [r for r in heldout if r.kind == kind]
        print(f"  held-out MAPE {kind:<7} {100 * mape(model, kind_rows):6.2f}%  ({len(kind_rows)} shapes)")
    try:
        model.to_json(args.output)
    except OSError as exc:
        print(f"astrolabe predictor fit: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import asyncio
    import random

    from predictor.profile import BackendProfiler, fit_nonnegative, parse_shapes, rows_to_profile, write_profile_csv
    from predictor.sim.batch_time import mape

    setup_logging(args.log_level, args.log_format)
    try:
        shapes = (parse_shapes(args.prefill_shapes, "prefill")
                  + parse_shapes(args.decode_shapes, "decode", args.decode_tokens))
        profiler = BackendProfiler(args.backend, random.Random(args.seed))
        rows = asyncio.run(profiler.run(shapes, args.repeats, args.device_name))
        write_profile_csv(rows, args.output)
    except (OSError, ValueError, RuntimeError, asyncio.TimeoutError) as exc:
        print(f"astrolabe predictor profile: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(rows)} shapes of {profiler.model} to {args.output}")
    if args.fit is not None:
        try:
            model = fit_nonnegative(rows_to_profile(rows))
            model.to_json(args.fit)
        except (OSError, ValueError) as exc:
            print(f"astrolabe predictor profile: cannot fit: {exc}", file=sys.stderr)
            return 1
        print(f"fitted {model.model}: MAPE on the measured shapes {100 * mape(model, rows_to_profile(rows)):.2f}%; "
              f"wrote {args.fit}")
    return 0


def _add_profile_parser(subparsers) -> None:
    profile = subparsers.add_parser("profile", help=COMMANDS["profile"], formatter_class=HelpFormatter)
    profile.add_argument("--backend", required=True, help="host:port (or http:// URL) of the vLLM server")
    profile.add_argument("-o", "--output", type=Path, required=True, help="profile CSV to write")
    profile.add_argument("--fit", type=Path, default=None,
                         help="also fit the measured rows and write the coefficients JSON here; default: no fit")
    from predictor import profile as defaults  # noqa: PLC0415

    profile.add_argument("--prefill-shapes", default=defaults.DEFAULT_PREFILL_SHAPES,
                         help="prefill runs as REQUESTSxPROMPT_TOKENS, comma-separated (keep requests x tokens "
                              "within the backend's max_num_batched_tokens)")
    profile.add_argument("--decode-shapes", default=defaults.DEFAULT_DECODE_SHAPES,
                         help="decode runs as REQUESTSxPROMPT_TOKENS, comma-separated (requests within the "
                              "backend's max_num_seqs)")
    profile.add_argument("--decode-tokens", type=int, default=defaults.DEFAULT_DECODE_TOKENS,
                         help="output tokens of each decode run, tokens")
    profile.add_argument("--repeats", type=int, default=2, help="runs per shape (the median is kept)")
    profile.add_argument("--device-name", default="backend", help="the value of the CSV's gpu column")
    profile.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    add_log_arguments(profile)
    profile.set_defaults(handler=_cmd_profile)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrolabe predictor", description="the predictor sidecar and its tools",
                                     formatter_class=HelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    fit = subparsers.add_parser("fit", help=COMMANDS["fit"], formatter_class=HelpFormatter)
    fit.add_argument("profile", type=Path, help="profile CSV (format of predictor/sim/h200_iteration_profile.csv)")
    fit.add_argument("--model", required=True, help="model shape, the CSV's `model` column (e.g. llama-2-7b)")
    fit.add_argument("-o", "--output", type=Path, required=True, help="coefficients JSON to write")
    fit.set_defaults(handler=_cmd_fit)
    _add_profile_parser(subparsers)
    from predictor import server  # noqa: PLC0415 (keeps `fit` free of gRPC imports until needed)

    serve = subparsers.add_parser("serve", help=COMMANDS["serve"], formatter_class=HelpFormatter)
    server.add_arguments(serve)
    serve.set_defaults(handler=server.run)
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe predictor`; returns the exit status (2 on a usage error)."""
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)
