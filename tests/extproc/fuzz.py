"""Long fuzzing run of the extproc's request handling: every Hypothesis property of ``test_fuzz_request.py`` and
``test_fuzz_stream.py``, in rounds, for a stated time.

    .venv/bin/python -m tests.extproc.fuzz --minutes 10                # all properties, about 10 minutes
    .venv/bin/python -m tests.extproc.fuzz --minutes 10 --target stream

Each round runs one property for ``--round-examples`` examples with a fresh random seed (Hypothesis' default),
so rounds explore different inputs; a failure is printed with Hypothesis' shrunk falsifying example (and saved to
its example database, ``.hypothesis/``, which replays it first in the next ``pytest`` run), and the run goes on.
One process, one thread of Python: it keeps to one core. Exit status 1 if any property failed.

Prints one line per property (``examples``: rounds x ``--round-examples``) and a total.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from tests.extproc.fuzz_bodies import FUZZ_EXAMPLES_ENV


def _properties(target: str) -> list[tuple[str, object]]:
    # Imported after FUZZ_EXAMPLES_ENV is set: each property reads it when its module is imported.
    from tests.extproc import test_fuzz_request as request  # noqa: PLC0415
    from tests.extproc import test_fuzz_stream as stream  # noqa: PLC0415

    found = []
    if target in ("request", "all"):
        found += [(name, getattr(request, name)) for name in (
            "test_any_body_is_read_or_refused_with_a_400", "test_well_typed_bodies_are_read_as_documented",
            "test_compression_never_changes_the_reading",
            "test_decoding_round_trips_within_the_limit_and_refuses_beyond",
            "test_truncated_or_trailing_compressed_data_is_refused")]
    if target in ("stream", "all"):
        found += [(f"test_every_stream_ends_with_a_clear_answer[{config}]",
                   lambda config=config: stream.test_every_stream_ends_with_a_clear_answer(config))
                  for config in sorted(stream.CONFIGS)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.extproc.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz, minutes")
    parser.add_argument("--target", choices=("request", "stream", "all"), default="all",
                        help="the body parser's properties, the ext_proc stream's, or both")
    parser.add_argument("--round-examples", type=int, default=500, help="examples per round of one property")
    args = parser.parse_args(argv)
    os.environ[FUZZ_EXAMPLES_ENV] = str(args.round_examples)
    properties = _properties(args.target)
    counts = {name: 0 for name, _ in properties}
    failures: dict[str, int] = {}
    start_s = time.monotonic()
    deadline_s = start_s + 60.0 * args.minutes
    while time.monotonic() < deadline_s:
        for name, run in properties:
            if time.monotonic() >= deadline_s:
                break
            try:
                run()
            except Exception:  # noqa: BLE001 - report and go on fuzzing
                failures[name] = failures.get(name, 0) + 1
                print(f"FAILED {name}:", file=sys.stderr)
                traceback.print_exc()
            counts[name] += args.round_examples
    elapsed_s = time.monotonic() - start_s
    for name, count in counts.items():
        print(f"{name}: {count} examples, {failures.get(name, 0)} failed rounds")
    print(f"total: {sum(counts.values())} examples in {elapsed_s:.0f} s, {sum(failures.values())} failed rounds")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
