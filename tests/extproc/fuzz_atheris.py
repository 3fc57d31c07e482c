"""Coverage-guided fuzzing of the body parser (``extproc.request``) with atheris (libFuzzer for Python).

Not collected by pytest (no ``test_`` prefix) and not needed by ``make test``: atheris is installed by hand.

    .venv/bin/pip install atheris          # 3.0.0 has a CPython 3.11 manylinux wheel
    mkdir -p /tmp/atheris-corpus
    .venv/bin/python -m tests.extproc.fuzz_atheris -max_total_time=600 -timeout=10 -rss_limit_mb=2048 \
        -dict=tests/extproc/fuzz_atheris.dict /tmp/atheris-corpus

An empty corpus directory is first seeded with well-formed completions and chat bodies. An input's first three
bytes choose the path (``fuzz_bodies.PATHS``), the ``content-encoding`` header (`HEADERS`) and whether the body
is really compressed that way (so that coverage reaches the JSON reader through gzip and deflate too); the rest
is the body. The property is ``test_fuzz_request.check_parse``: a well-formed ``RoutingRequest`` or a 400 with an
OpenAI-style body, nothing else. libFuzzer reports a crash (any other exception), a timeout (``-timeout``,
default 1200 s per input: pass e.g. ``-timeout=10``) or memory over ``-rss_limit_mb``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import extproc.request  # noqa: F401 - instrumented for coverage before the tests import it

from tests.extproc.fuzz_bodies import CODINGS, PATHS, WRONG_CODINGS, encode  # noqa: E402
from tests.extproc.test_fuzz_request import check_parse  # noqa: E402

HEADERS = [None, "", *CODINGS, *WRONG_CODINGS, "gzip, gzip", "deflate, gzip", "identity, gzip"]
"""``content-encoding`` values an input's second byte picks from."""

SEEDS = [
    (0, 0, b'{"model": "m", "prompt": "hello", "max_tokens": 7, "stream": true}'),
    (0, 0, b'{"prompt": [[1, 2], [3]], "max_tokens": 4.0}'),
    (1, 0, (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
            b'{"type": "image_url", "image_url": {"url": "x"}}]}], "max_completion_tokens": 5}')),
    (1, 3, (b'{"messages": [{"role": "assistant", "content": null, "tool_calls": []}, '
            b'{"role": "user", "content": "q"}]}')),
]


def one_input(data: bytes) -> None:
    """One libFuzzer input: byte 0 picks the path, byte 1 the header, byte 2's low bit says whether to compress;
    the rest is the body."""
    if len(data) < 3:
        return
    path = PATHS[data[0] % len(PATHS)]
    header = HEADERS[data[1] % len(HEADERS)]
    body = data[3:]
    if data[2] & 1 and header:
        body = encode(body, [c.strip().lower() for c in header.split(",")])
    check_parse(path, body, header)


def _seed(corpus: Path) -> None:
    """Writes `SEEDS` into an empty corpus directory, in `one_input`'s layout."""
    for i, (path_index, header_index, body) in enumerate(SEEDS):
        json.loads(body)  # a seed is valid JSON
        (corpus / f"seed-{i}").write_bytes(bytes([path_index, header_index, 1]) + body)


def main() -> None:
    corpora = [Path(a) for a in sys.argv[1:] if not a.startswith("-")]
    for corpus in corpora:
        if corpus.is_dir() and not any(corpus.iterdir()):
            _seed(corpus)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
