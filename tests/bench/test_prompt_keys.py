"""`astrolabe bench prompt-keys` runs and prints its two tables (a smoke run: its figures are not asserted)."""

from bench.prompt_keys import main


def test_a_small_run_prints_the_cost_per_request_and_the_state_bytes(capsys):
    assert main(["--tokens", "60", "300", "--repeats", "2", "--state", "--state-prompt-tokens", "64",
                 "--shared-prefix", "32", "--cached-blocks", "10"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 2 + 6  # two prompt sizes, then (64, 256 requests) x 3 kinds
    sizes = {(r[0], " ".join(r[1:-3])): int(r[-3].replace(",", "")) for r in rows[2:]}
    assert sizes[("64", "no keys")] < sizes[("64", "keys, 32-token system prompt")] < \
        sizes[("64", "keys, nothing shared")] < sizes[("256", "keys, nothing shared")]
