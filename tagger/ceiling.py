"""How well can any tagger rank ShareGPT replies? The label noise, measured where one prompt has several replies.

A reply length is one draw from the distribution of replies the prompt could get: the same prompt sent twice gets
two lengths. A tagger that knew each prompt's distribution exactly would still not rank single replies perfectly.
This module measures that bound on the data the taggers are scored on (``astrolabe tagger ceiling``).

Method:

1. Repeated prompts (:func:`repeated_prompts`): first exchanges of the ShareGPT file whose prompt text (stripped)
   opens several records with different reply texts (identical reply texts are the same conversation shared twice
   and count once). Prompts that continue a conversation the record does not hold (``"continue"``,
   `CONTINUATION_PROMPTS`) are left out: their replies answer different hidden contexts.
2. Within-prompt noise: the pooled variance of ``log1p(reply tokens)`` around each prompt's own mean
   (:func:`within_prompt_variance`, degrees of freedom summed over prompts). Two side figures describe it: the
   median relative miss of a reply by the median of its prompt's other replies (:func:`median_relative_miss`), and
   the Kendall tau-b between two replies of each prompt drawn at random (:func:`two_draw_tau`: how well one
   observed reply ranks another of the same prompt).
3. The ceiling of a view (:func:`ceiling_tau`): with ``log1p(tokens) = m(prompt) + e``, ``e`` of the measured
   variance ``w`` and independent of ``m``, the best possible predictor ``m`` correlates with the label at
   ``rho = sqrt(1 - w / total)``, ``total`` the view's label variance; under a bivariate normal link Kendall's
   ``tau = (2 / pi) * arcsin(rho)`` (Greiner's relation; Kendall & Gibbons, "Rank Correlation Methods", 1990,
   ch. 10). The same link predicts the repeated prompts' own two-draw tau (``rho = 1 - w / total`` there); the
   report prints it beside the observed one as a check of the link.
4. Intervals: a bootstrap over prompts (and over the view's exchanges for its variance).

Assumptions a reader should weigh: the repeated prompts are not a sample of the test views (many are greetings and
popular "act as" prompts), and the noise is assumed the same for every prompt; ShareGPT's replies also mix model
versions (a source of spread a served model would not have). Imports only the stdlib, numpy and ``tagger`` modules
that do not import torch.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tagger.evaluate import kendall_tau_b
from tagger.sharegpt import first_exchange

CONTINUATION_PROMPTS = frozenset({"continue", "please continue", "continue writing please", "go on", "go ahead",
                                  "keep going", "more", "next", "lets go", "let's go"})
"""Prompts (lower case, trailing ``.!`` cut) that continue a context the record does not hold: left out."""

MIN_BOOTSTRAP = 100
"""Fewest bootstrap resamples `measure_ceiling` takes: the 2.5th and 97.5th percentiles of fewer mean little."""

NUM_PAIRINGS = 200
"""Random pairings of two replies per prompt averaged for the observed two-reply tau (`two_draw_tau`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RepeatedPrompt:
    """One prompt that opens several ShareGPT records with different replies.

    Attributes:
        prompt: the prompt text, stripped.
        num_output_tokens: each distinct reply's length, tokens (label tokenizer); at least 2 entries.
    """

    prompt: str
    num_output_tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Estimate:
    """A figure with its bootstrap interval (``low``, ``high``: the 2.5th and 97.5th percentiles)."""

    value: float
    low: float
    high: float


@dataclasses.dataclass(frozen=True, slots=True)
class CeilingReport:
    """What ``astrolabe tagger ceiling`` prints.

    Attributes:
        num_prompts, num_replies: repeated prompts and their distinct replies.
        within_sd: square root of the within-prompt variance of ``log1p(tokens)``.
        median_relative_miss: median of ``|reply - median(other replies)| / reply``.
        two_draw_tau: observed Kendall tau-b between two replies of each repeated prompt.
        two_draw_tau_link: the same, as the normal link predicts it from the variances (the check).
        views: view name -> (its exchanges, the ceiling tau).
        num_bootstrap, seed: how the intervals were drawn.
    """

    num_prompts: int
    num_replies: int
    within_sd: Estimate
    median_relative_miss: Estimate
    two_draw_tau: Estimate
    two_draw_tau_link: Estimate
    views: dict[str, tuple[int, Estimate]]
    num_bootstrap: int = 0
    seed: int = 0


def is_continuation(prompt: str) -> bool:
    """True for a prompt that continues a context its record does not hold (`CONTINUATION_PROMPTS`)."""
    return prompt.strip().lower().rstrip(".!") in CONTINUATION_PROMPTS


def repeated_prompts(records: Iterable[object],
                     count_tokens_batch: Callable[[list[str]], list[int]]) -> list[RepeatedPrompt]:
    """The prompts that open at least two records with different reply texts (continuations left out).

    Args:
        records: decoded ShareGPT records (``tagger.sharegpt.iter_json_array_records``).
        count_tokens_batch: texts -> token counts, same order (the label tokenizer's).

    Returns:
        One entry per such prompt, in order of first appearance; blank prompts and blank replies are skipped.
    """
    replies: dict[str, dict[str, None]] = {}
    for record in records:
        exchange = first_exchange(record)
        if exchange is None or not exchange[0].strip() or not exchange[1].strip():
            continue
        prompt = exchange[0].strip()
        if not is_continuation(prompt):
            replies.setdefault(prompt, {})[exchange[1].strip()] = None
    repeated = [(prompt, list(texts)) for prompt, texts in replies.items() if len(texts) >= 2]
    counts = iter(count_tokens_batch([text for _, texts in repeated for text in texts]))
    return [RepeatedPrompt(prompt, tuple(next(counts) for _ in texts)) for prompt, texts in repeated]


def _log_lengths(groups: Sequence[Sequence[int]]) -> list[np.ndarray]:
    return [np.log1p(np.asarray(group, dtype=float)) for group in groups]


def within_prompt_variance(groups: Sequence[Sequence[int]]) -> float:
    """Pooled variance of ``log1p(tokens)`` around each group's mean: ``sum((x - mean_g)^2) / sum(n_g - 1)``.

    Raises:
        ValueError: no group has two or more lengths.
    """
    logs = [x for x in _log_lengths(groups) if len(x) >= 2]
    if not logs:
        raise ValueError("no group with two or more lengths")
    return float(sum(((x - x.mean()) ** 2).sum() for x in logs) / sum(len(x) - 1 for x in logs))


def median_relative_miss(groups: Sequence[Sequence[int]]) -> float:
    """Median over replies of ``|reply - median(the group's other replies)| / max(reply, 1)``."""
    misses = [abs(g[i] - float(np.median([g[j] for j in range(len(g)) if j != i]))) / max(g[i], 1)
              for g in groups for i in range(len(g))]
    return float(np.median(misses))


def _two_draws(groups: Sequence[Sequence[int]], rng: random.Random) -> tuple[list[int], list[int]]:
    first, second = [], []
    for group in groups:
        i, j = rng.sample(range(len(group)), 2)
        first.append(group[i])
        second.append(group[j])
    return first, second


def two_draw_tau(groups: Sequence[Sequence[int]], rng: random.Random, num_draws: int = 50) -> tuple[float, float]:
    """Kendall tau-b between two replies drawn at random from each group, averaged over ``num_draws`` draws, and
    what the normal link predicts for it: ``(2 / pi) * arcsin(1 - w / total)``, ``w`` the within-group variance
    and ``total`` the variance of the drawn ``log1p(tokens)``."""
    observed, totals = [], []
    for _ in range(num_draws):
        first, second = _two_draws(groups, rng)
        observed.append(kendall_tau_b(first, second))
        totals.append(float(np.log1p(np.asarray(first + second, dtype=float)).var()))
    rho = 1.0 - within_prompt_variance(groups) / float(np.mean(totals))
    return float(np.mean(observed)), 2.0 / math.pi * math.asin(max(-1.0, min(1.0, rho)))


def ceiling_tau(within_variance: float, total_variance: float) -> float:
    """The Kendall tau of a perfect predictor of each prompt's mean ``log1p(tokens)`` against single replies:
    ``(2 / pi) * arcsin(sqrt(1 - within / total))`` (0 when the noise is all the variance; see the module
    docstring for the model and its source).

    Raises:
        ValueError: ``total_variance`` is not above 0.
    """
    if not total_variance > 0.0:
        raise ValueError(f"total variance must be above 0, got {total_variance}")
    return 2.0 / math.pi * math.asin(math.sqrt(max(0.0, 1.0 - within_variance / total_variance)))


def measure_ceiling(repeated: Sequence[RepeatedPrompt], views: dict[str, Sequence[int]], num_bootstrap: int = 1000,
                    seed: int = 0) -> CeilingReport:
    """The ceiling of each view's Kendall tau and the noise figures, each with a bootstrap interval.

    Args:
        repeated: the repeated prompts (:func:`repeated_prompts`); at least 2.
        views: view name -> the true reply lengths of its exchanges, tokens.
        num_bootstrap: bootstrap resamples (prompts, and each view's exchanges, drawn with replacement); at least
            `MIN_BOOTSTRAP`.
        seed: seeds the resamples and the pairings (the observed two-reply tau is a mean over `NUM_PAIRINGS`
            random pairings, so its point value moves slightly with the seed).

    Returns:
        The report; each interval is the 2.5th-97.5th percentile of the resampled figure (a resampled figure's
        two-reply tau averages 5 pairings).

    Raises:
        ValueError: fewer than 2 repeated prompts, a view with fewer than 2 exchanges or with one length only, or
            ``num_bootstrap`` under `MIN_BOOTSTRAP`.
    """
    groups = [list(r.num_output_tokens) for r in repeated]
    if len(groups) < 2:
        raise ValueError(f"need at least 2 repeated prompts, got {len(groups)}")
    if num_bootstrap < MIN_BOOTSTRAP:
        raise ValueError(f"need at least {MIN_BOOTSTRAP} bootstrap resamples, got {num_bootstrap}")
    view_logs = {name: np.log1p(np.asarray(lengths, dtype=float)) for name, lengths in views.items()}
    if any(len(x) < 2 or not x.var() > 0 for x in view_logs.values()):
        raise ValueError("every view needs at least 2 exchanges of different lengths")
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)

    def figures(sample: list[list[int]], logs: dict[str, np.ndarray], num_pairings: int) -> list[float]:
        w = within_prompt_variance(sample)
        observed, link = two_draw_tau(sample, rng, num_draws=num_pairings)
        variances = [float(x.var()) for x in logs.values()]
        return [math.sqrt(w), median_relative_miss(sample), observed, link,
                *(ceiling_tau(w, v) if v > 0 else math.nan for v in variances)]

    point = figures(groups, view_logs, NUM_PAIRINGS)
    draws = np.array([figures([groups[i] for i in np_rng.integers(0, len(groups), len(groups))],
                              {name: x[np_rng.integers(0, len(x), len(x))] for name, x in view_logs.items()}, 5)
                      for _ in range(num_bootstrap)])
    # a resampled view can hold one length only (tiny views): it has no ceiling, and is left out
    low, high = np.nanpercentile(draws, 2.5, axis=0), np.nanpercentile(draws, 97.5, axis=0)
    estimates = [Estimate(p, float(lo), float(hi)) for p, lo, hi in zip(point, low, high)]
    return CeilingReport(
        num_prompts=len(groups), num_replies=sum(map(len, groups)), within_sd=estimates[0],
        median_relative_miss=estimates[1], two_draw_tau=estimates[2], two_draw_tau_link=estimates[3],
        views={name: (len(view_logs[name]), estimates[4 + k]) for k, name in enumerate(view_logs)},
        num_bootstrap=num_bootstrap, seed=seed)


def _fmt(e: Estimate, digits: int = 3) -> str:
    return f"{e.value:.{digits}f} [{e.low:.{digits}f}, {e.high:.{digits}f}]"


def format_ceiling(report: CeilingReport, taggers: dict[str, dict[str, float]] | None = None) -> str:
    """The printed report; ``taggers``: tagger name -> view name -> its Kendall tau on that view (optional
    columns beside the ceiling)."""
    taggers = taggers or {}
    lines = [
        f"repeated prompts: {report.num_prompts} prompts with {report.num_replies} distinct replies "
        f"(first exchanges; continuations left out)",
        f"within-prompt sd of log1p(tokens): {_fmt(report.within_sd)}",
        f"median relative miss of a reply by its prompt's other replies: {_fmt(report.median_relative_miss, 2)}",
        f"two replies of one prompt, Kendall tau: observed {_fmt(report.two_draw_tau)} (mean of {NUM_PAIRINGS} "
        f"random pairings), as the normal model predicts it from the variances {_fmt(report.two_draw_tau_link)} "
        f"(the check of the model behind the ceiling: tagger/ceiling.py)",
        f"[low, high]: 95% bootstrap intervals, {report.num_bootstrap} resamples of the prompts and of each view, "
        f"seed {report.seed}",
        "",
        "| view | exchanges | ceiling Kendall tau [95% CI] |" + "".join(f" {name} |" for name in taggers),
        "| --- | ---: | ---: |" + " ---: |" * len(taggers),
    ]
    for view, (n, estimate) in report.views.items():
        lines.append(f"| {view} | {n} | {_fmt(estimate)} |"
                     + "".join(f" {taus.get(view, float('nan')):.3f} |" for taus in taggers.values()))
    return "\n".join(lines)
