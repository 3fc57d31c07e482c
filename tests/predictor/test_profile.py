"""`predictor.profile` against the real emulator over HTTP (it exposes vLLM's histograms), plus its pure parts."""

import random

import pytest

from bench.emulator.server import EmulatorConfig, start_emulator
from predictor.backend_metrics import histogram_totals
from predictor.profile import (
    BackendProfiler,
    default_shapes,
    fit_nonnegative,
    parse_shapes,
    rows_to_profile,
    write_profile_csv,
)
from predictor.sim import EngineConfig, LinearBatchTimeModel, ProfileRow, load_profile

ENGINE = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=512)

METRICS_TEXT = """# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",model_name="m",le="+Inf"} 3.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 3.0
vllm:inter_token_latency_seconds_bucket{engine="1",model_name="m",le="+Inf"} 1.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 0.25
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 1.0
"""


def test_histogram_totals_sum_over_engines():
    assert histogram_totals(METRICS_TEXT, "vllm:inter_token_latency_seconds") == (0.75, 4.0)
    assert histogram_totals(METRICS_TEXT, "vllm:request_prefill_time_seconds") == (0.0, 0.0)


@pytest.mark.parametrize("text, error", [("2x", "invalid literal"), ("0x16", ">= 1"), ("x", "invalid literal")],
                         ids=["no-tokens", "zero-seqs", "empty-parts"])
def test_bad_shapes_are_rejected(text, error):
    with pytest.raises(ValueError, match=error):
        parse_shapes(text, "prefill")


def test_default_shapes_fit_the_tiny_servers():
    for shape in default_shapes():
        assert shape.num_seqs <= 16 and shape.num_prompt_tokens + shape.num_output_tokens <= 256
        if shape.kind == "prefill":
            assert shape.num_seqs * shape.num_prompt_tokens <= 256


def test_nonnegative_fit_recovers_a_nonnegative_model_and_clamps_a_negative_one():
    truth = LinearBatchTimeModel("m", 0.005, 2e-5, 1e-9, 1e-7, 0.0)
    shapes = [(p, n, 0, 0) for p in (16, 64, 256) for n in (1, 2, 4)] + [(0, 0, d, c) for d in (1, 8, 32)
                                                                       for c in (64, 512)]
    rows = []
    for prefill_len, prefill_seqs, decode_seqs, ctx in shapes:
        row = ProfileRow("m", "prefill" if prefill_seqs else "decode", prefill_seqs, prefill_len, decode_seqs,
                         decode_seqs * ctx, prefill_seqs * prefill_len + decode_seqs, 1.0)
        rows.append(ProfileRow(**{**{f: getattr(row, f) for f in ProfileRow.__slots__},
                                  "time_s": truth.step_time_s(row.to_batch())}))
    fitted = fit_nonnegative(rows)
    assert fitted.c0_s == pytest.approx(truth.c0_s, rel=1e-6)
    assert fitted.c3_s_per_token == pytest.approx(truth.c3_s_per_token, rel=1e-4)
    # Times that fall with context would need a negative c3: it is clamped to 0 instead.
    falling = [ProfileRow(**{**{f: getattr(r, f) for f in ProfileRow.__slots__},
                             "time_s": r.time_s - 2e-8 * r.decode_ctx_sum}) for r in rows]
    clamped = fit_nonnegative(falling)
    assert min(clamped.c0_s, clamped.c1_s_per_token, clamped.c2_s_per_token2, clamped.c3_s_per_token,
               clamped.c4_s_per_seq) >= 0


async def test_profiler_measures_the_emulator_and_writes_a_loadable_csv(tmp_path):
    emulator = await start_emulator(EmulatorConfig(port=0, engine=ENGINE, time_scale=20.0))
    try:
        profiler = BackendProfiler(f"127.0.0.1:{emulator.port}", random.Random(0))
        shapes = parse_shapes("1x32,2x64", "prefill") + parse_shapes("1x16,4x16", "decode", 8)
        rows = await profiler.run(shapes, 1, "emulated H200 x 20")
    finally:
        await emulator.stop()
    path = tmp_path / "profile.csv"
    write_profile_csv(rows, path)
    loaded = load_profile(path, profiler.model)
    assert loaded == rows_to_profile(rows)
    assert [r.kind for r in loaded] == ["prefill", "prefill", "decode", "decode"]
    # The emulator runs H200 step times x 20 (~0.1 s or more per step): far from zero, well under a minute.
    assert all(0.05 < r.time_s < 60 for r in loaded)
