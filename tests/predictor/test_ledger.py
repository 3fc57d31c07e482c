"""The sidecar's ledger: admission, release, simulated progress, reconciliation with backend gauges."""

import pytest

from predictor.ledger import BackendObservation, Ledger
from predictor.residual_rules import LENGTH_SOURCE_EXACT, LENGTH_SOURCE_TAGGER, ResidualRules
from predictor.sim import EngineConfig, LinearBatchTimeModel

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_gpu_blocks=64)
MODEL = LinearBatchTimeModel.default("llama-2-7b")


def ledger(now_s=0.0, **kwargs):
    return Ledger(CONFIG, MODEL, now_s, **kwargs)


def test_admit_release_and_duplicates():
    led = ledger()
    assert led.admit("a", 10, 5, now_s=0.0)
    assert not led.admit("a", 10, 5, now_s=0.0)
    assert led.num_unfinished() == 1
    assert led.release("a", now_s=0.001)
    assert not led.release("a", now_s=0.001)
    assert led.num_unfinished() == 0


def test_admitted_requests_run_until_released_and_predict_with_their_predicted_length():
    led = ledger()
    led.admit("a", 10, 3, now_s=0.0)
    led.advance(0.5)  # ~80 steps of ~6 ms: far past the predicted 3 tokens, but no Release yet
    (running,) = led.scheduler.running
    assert running.num_generated_tokens > 3
    (state,) = led.snapshot().running
    # without residual rules: the reference system's "10 more tokens" once past the prediction
    assert state.num_output_tokens == running.num_generated_tokens + 10
    assert state.num_remaining_output_tokens == 10
    assert led.release("a", now_s=0.5) and led.num_unfinished() == 0


def test_snapshot_applies_each_requests_residual_rule_and_cap():
    rules = ResidualRules()
    led = ledger(residual=rules.for_source)
    led.admit("tagged", 10, 3, now_s=0.0, length_source=LENGTH_SOURCE_TAGGER)
    led.admit("exact", 10, 3, now_s=0.0, length_source=LENGTH_SOURCE_EXACT)
    led.admit("capped", 10, 3, now_s=0.0, max_tokens=60, length_source=LENGTH_SOURCE_TAGGER)
    led.advance(0.3)
    states = {s.request_id: s for s in led.snapshot().running}
    generated = {r.request_id: r.num_generated_tokens for r in led.scheduler.running}
    assert all(g > 3 for g in generated.values())
    # a tagged request past its guess is expected to run on as replies that long do (far more than 10 tokens)
    assert states["tagged"].num_output_tokens - generated["tagged"] > 10
    assert states["exact"].num_output_tokens == generated["exact"] + 1
    assert generated["capped"] < states["capped"].num_output_tokens <= 60


def test_an_estimate_past_the_kv_cache_is_admitted_as_predict_priced_it():
    """Predict cuts an estimate to what the KV cache holds beside the prompt (InstanceSnapshot.fit_request): the
    Admit that follows must not be refused for it. A prompt larger than the cache stays refused."""
    led = ledger()
    assert led.admit("long estimate", 20, 5000, now_s=0.0)
    assert led.admit("long estimate, capped", 20, 5000, now_s=0.0, max_tokens=2)
    assert led.admit("prompt near the cache", 1000, 100, now_s=0.0)  # 1,100 tokens > 64 blocks x 16
    with pytest.raises(ValueError):
        led.admit("prompt past the cache", 2000, 10, now_s=0.0)


def test_phantoms_finish_on_their_own():
    led = ledger()
    led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.0)
    assert led.num_unfinished() == 1
    led.advance(60.0)
    assert led.num_unfinished() == 0


def test_reconcile_adds_phantoms_for_requests_from_elsewhere():
    led = ledger()
    led.admit("a", 100, 100, now_s=0.0)
    change = led.reconcile(BackendObservation(num_running=3, num_waiting=2), now_s=0.0)
    assert change == 4 and led.num_unfinished() == 5
    assert led.stats.num_phantoms_added == 4
    # phantoms take the lengths of recent admissions
    phantom = next(r for r in led.scheduler.waiting if r.request_id.startswith("phantom-"))
    assert phantom.num_prompt_tokens > 0 and phantom.num_output_tokens > 0


def test_reconcile_removes_extra_requests_but_not_recent_ones():
    led = ledger(visibility_grace_s=1.0)
    for i in range(3):
        led.admit(f"old{i}", 50, 400, now_s=0.0)
    led.admit("recent", 50, 400, now_s=1.5)
    # the backend shows 1 request; "recent" is protected (admitted 0.1 s ago), so two old ones go
    change = led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=1.6)
    assert change == -2
    ids = {r.request_id for r in (*led.scheduler.running, *led.scheduler.waiting)}
    assert "recent" in ids and len(ids) == 2


def test_reconcile_removes_the_most_overdue_first():
    led = ledger(visibility_grace_s=0.0)
    led.admit("short", 20, 2, now_s=0.0)
    led.admit("long", 20, 400, now_s=0.0)
    led.advance(0.3)
    led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.3)
    ids = {r.request_id for r in (*led.scheduler.running, *led.scheduler.waiting)}
    assert ids == {"long"}  # "short" is far past its prediction: its Release was most likely lost


def test_reconcile_and_phantoms_use_the_estimate_capped_by_max_tokens():
    """An estimate of 900 tokens (it fits the 1,024-token cache beside a 20-token prompt) under max_tokens 2 is a
    2-token request: past it after a few steps (so the most overdue, removed first), and what phantoms are made of
    (the mean of recent admissions)."""
    led = ledger(visibility_grace_s=0.0)
    for i in range(40):
        led.admit(f"capped{i}", 20, 900, now_s=0.0, max_tokens=2)
        led.release(f"capped{i}", now_s=0.0)
    led.admit("capped", 20, 900, now_s=0.0, max_tokens=2)
    led.admit("long", 20, 400, now_s=0.0)
    led.advance(0.05)
    led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.05)
    assert {r.request_id for r in (*led.scheduler.running, *led.scheduler.waiting)} == {"long"}
    led.reconcile(BackendObservation(num_running=2, num_waiting=0), now_s=0.05)
    phantom = next(r for r in led.scheduler.waiting if r.request_id.startswith("phantom-"))
    assert phantom.num_output_tokens < 100  # the mean moved towards 2 tokens (and 400 once), not towards 900


def test_reconcile_and_phantoms_use_the_estimate_capped_by_the_kv_cache():
    """An estimate past what the KV cache holds beside the prompt (5,000 tokens on a 1,024-token cache, prompt 20)
    is priced as 1,004 tokens, as Predict cut it: it ranks as closer to its end than an estimate of 1,010 that fits
    beside a 10-token prompt (admission order does not decide it), and the phantoms made from such admissions fit
    the cache (uncapped, the mean would make phantoms that cannot fit, and none would be added)."""
    led = ledger(visibility_grace_s=0.0)
    for i in range(40):
        led.admit(f"long{i}", 20, 5000, now_s=0.0)
        led.release(f"long{i}", now_s=0.0)
    led.admit("fits", 10, 1010, now_s=0.0)  # 10 + 1,010 <= 1,024: not capped
    led.admit("past the cache", 20, 5000, now_s=0.0)
    led.advance(0.05)
    led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.05)
    assert {r.request_id for r in (*led.scheduler.running, *led.scheduler.waiting)} == {"fits"}
    assert led.reconcile(BackendObservation(num_running=2, num_waiting=0), now_s=0.05) == 1
    phantom = next(r for r in led.scheduler.waiting if r.request_id.startswith("phantom-"))
    assert 900 < phantom.num_output_tokens <= 1004


def test_reconcile_removes_phantoms_first():
    led = ledger(visibility_grace_s=0.0)
    led.admit("real", 50, 400, now_s=0.0)
    led.reconcile(BackendObservation(num_running=3, num_waiting=0), now_s=0.0)
    assert led.num_unfinished() == 3
    led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.01)
    ids = {r.request_id for r in (*led.scheduler.running, *led.scheduler.waiting)}
    assert ids == {"real"}


def test_phantoms_leave_before_a_request_past_its_prediction():
    """The phantoms-first rule on its own: "real" is 13 tokens past its predicted length, the one the overdue rule
    alone would remove first (test_reconcile_removes_the_most_overdue_first); phantoms (length 245, none generated) go
    first anyway, since they stand for nothing the extproc admitted."""
    led = ledger(visibility_grace_s=0.0)
    led.admit("real", 50, 40, now_s=0.0)
    led.advance(0.3)  # 53 tokens generated of the 40 predicted
    led.reconcile(BackendObservation(num_running=3, num_waiting=0), now_s=0.3)
    assert led.num_unfinished() == 3
    led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.31)
    assert {r.request_id for r in (*led.scheduler.running, *led.scheduler.waiting)} == {"real"}


def test_reconcile_agreeing_changes_nothing():
    led = ledger()
    led.admit("a", 50, 400, now_s=0.0)
    assert led.reconcile(BackendObservation(num_running=1, num_waiting=0), now_s=0.0) == 0


def test_admit_rejects_a_request_that_can_never_fit():
    with pytest.raises(ValueError):
        ledger().admit("huge", 64 * 16, 10, now_s=0.0)
