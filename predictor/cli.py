"""`astrolabe predictor <sub>`: the predictor sidecar (`serve`) and its tools (`fit`).

`serve --backend HOST:PORT --listen HOST:PORT ...` runs the sidecar beside one backend (`predictor.server`).

`fit PROFILE.csv --model NAME -o COEFFS.json` fits `LinearBatchTimeModel` on the fixed training split of the
profile's rows for one model shape (`predictor.sim.batch_time.split_holdout`: 1 shape in 5 of each kind held
out), prints the mean absolute percentage error (MAPE) on the held-out shapes, overall and per kind, and writes
the coefficients in the format of the shipped JSON files (`LinearBatchTimeModel.to_json`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrolabe predictor", description="predictor tools")
    subparsers = parser.add_subparsers(dest="command", required=True)
    fit = subparsers.add_parser("fit", help="fit the batch-time model on a profile CSV; print held-out MAPE")
    fit.add_argument("profile", type=Path, help="profile CSV (format of predictor/sim/h200_iteration_profile.csv)")
    fit.add_argument("--model", required=True, help="model shape, the CSV's `model` column (e.g. llama-2-7b)")
    fit.add_argument("-o", "--output", type=Path, required=True, help="coefficients JSON to write")
    fit.set_defaults(handler=_cmd_fit)
    from predictor import server  # noqa: PLC0415 (keeps `fit` free of gRPC imports until needed)

    serve = subparsers.add_parser("serve", help="run the predictor sidecar beside one backend")
    server.add_arguments(serve)
    serve.set_defaults(handler=server.run)
    return parser


def main(argv: list[str]) -> int:
    """Entry point of `astrolabe predictor`; returns the exit status (2 on a usage error)."""
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)
