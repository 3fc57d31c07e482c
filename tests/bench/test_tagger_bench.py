"""bench.tagger_bench: the latency table (light tagger; the transformer row is exercised by the tagger tier)."""

import pytest

from bench.cli import BENCHMARKS
from bench.tagger_bench import main, percentile


def test_registered_in_bench_cli():
    assert BENCHMARKS["tagger"][0] == "bench.tagger_bench"


@pytest.mark.parametrize("values, q, expected", [([3.0], 0.99, 3.0), ([1.0, 2.0, 3.0], 0.5, 2.0),
                                                 ([0.0, 10.0], 0.99, 9.9)], ids=["one", "odd", "interp"])
def test_percentile(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_light_rows_at_two_concurrency_levels(capsys):
    """Both light services at both levels; as served, the short held-out prompts are tagged inline (no batch), the
    batched-only service tags none inline; every row has a CPU cost per request."""
    assert main(["--kinds", "light", "--num-requests", "20", "--concurrency", "1", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    for name in ("light (as served)", "light (batched only)"):
        rows = [line.split("|") for line in out if line.startswith(f"| {name} |")]
        assert [row[2].strip() for row in rows] == ["1", "4"]
        assert all(row[3].strip() == "20" and float(row[7]) > 0 for row in rows)
        inline = [int(row[8]) for row in rows]
        if "batched" in name:
            assert inline == [0, 0]
        else:
            assert all(0 < n <= 20 for n in inline), inline


@pytest.mark.tagger
def test_transformer_row(capsys):
    assert main(["--kinds", "transformer", "--num-requests", "8", "--concurrency", "4", "--threads", "1"]) == 0
    assert "| transformer" in capsys.readouterr().out
