"""`astrolabe bench kv-events` prints a row per case, both encodings, and refuses bad arguments."""

from __future__ import annotations

import pytest

from bench import kv_events_bench


def test_prints_every_case(capsys):
    assert kv_events_bench.main(["--batches", "5", "--block-size", "4"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [row[0] for row in rows] == ["map"] * 3 + ["positional"] * 3
    assert all(float(row[3]) > 0 for row in rows)


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as exc:
        kv_events_bench.main(["--batches", "0"])
    assert exc.value.code == 2
