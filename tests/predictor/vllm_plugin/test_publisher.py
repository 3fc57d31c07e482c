"""The plugin's state publisher writes what the reader parses, throttles, and never raises into vLLM."""

import json
import time


from predictor.state_source import parse_plugin_state
from predictor.vllm_plugin import ENV_STATE_PATH, register
from predictor.vllm_plugin.publisher import STATE_FORMAT_VERSION, StatePublisher
from tests.predictor.vllm_plugin.fake_vllm import FakeRequest, FakeSamplingParams, FakeScheduler


def scheduler_with_two_requests() -> FakeScheduler:
    running = [FakeRequest("cmpl-a-0", 100, num_computed_tokens=104, num_output_tokens=5,
                           sampling_params=FakeSamplingParams(max_tokens=50))]
    waiting = [FakeRequest("cmpl-b-0", 30, num_preemptions=1)]
    return FakeScheduler(running, waiting, blocks={"cmpl-a-0": 7})


def test_published_state_round_trips_through_the_reader(tmp_path):
    path = tmp_path / "state.json"
    StatePublisher(str(path), 0.0, synchronous=True).maybe_publish(scheduler_with_two_requests())
    raw = json.loads(path.read_text())
    assert raw["version"] == STATE_FORMAT_VERSION
    state = parse_plugin_state(path.read_text())
    assert state.engine.num_gpu_blocks == 64  # vLLM's null block excluded
    assert (state.engine.max_num_seqs, state.engine.max_num_batched_tokens, state.engine.block_size) == (8, 256, 16)
    assert state.num_free_blocks == 40 and state.num_preemptions_total == 1
    assert state.running == (("cmpl-a-0", 100, 104, 5, 50, None, 0),)
    assert state.waiting == (("cmpl-b-0", 30, 0, 0, None, None, 1),)
    assert not list(tmp_path.glob("*.tmp*"))  # the temporary file was renamed away


def test_a_busy_engine_is_published_at_most_once_per_interval_and_idling_at_once(tmp_path):
    path = tmp_path / "state.json"
    publisher = StatePublisher(str(path), min_interval_s=3600.0, synchronous=True)
    scheduler = scheduler_with_two_requests()
    publisher.maybe_publish(scheduler)
    scheduler.running[0].num_output_tokens = 6
    scheduler.waiting.pop()
    publisher.maybe_publish(scheduler)  # still busy, interval not over: skipped
    assert publisher.num_published == 1
    scheduler.running.pop()
    publisher.maybe_publish(scheduler)  # turned idle: published at once
    assert publisher.num_published == 2 and parse_plugin_state(path.read_text()).num_unfinished == 0
    scheduler.waiting.append(FakeRequest("cmpl-c-0", 10))
    publisher.maybe_publish(scheduler)  # turned busy (a request arrived): published at once
    assert publisher.num_published == 3 and parse_plugin_state(path.read_text()).waiting[0][0] == "cmpl-c-0"


def test_a_failing_write_disables_publishing_without_raising(tmp_path):
    publisher = StatePublisher(str(tmp_path / "missing-dir" / "state.json"), 0.0, synchronous=True)
    publisher.maybe_publish(scheduler_with_two_requests())  # must not raise
    publisher.maybe_publish(scheduler_with_two_requests())
    assert publisher.num_published == 1 and not (tmp_path / "missing-dir").exists()


def test_register_without_the_variable_does_nothing(monkeypatch):
    monkeypatch.delenv(ENV_STATE_PATH, raising=False)
    register()  # vLLM is not installed in this venv: must return quietly before importing it


def test_register_without_vllm_logs_why_and_returns(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(ENV_STATE_PATH, str(tmp_path / "state.json"))
    register()
    assert "cannot attach" in caplog.text
    assert not (tmp_path / "state.json").exists()


def test_the_writer_thread_writes_the_newest_state(tmp_path):
    path = tmp_path / "state.json"
    publisher = StatePublisher(str(path), 0.0)  # as inside vLLM: the engine thread only hands the state over
    scheduler = scheduler_with_two_requests()
    for generated in range(1, 6):
        scheduler.running[0].num_output_tokens = generated
        publisher._last_counts = (-1, -1)  # noqa: SLF001 (make every call due)
        publisher.maybe_publish(scheduler)
    deadline_s = time.monotonic() + 30
    while time.monotonic() < deadline_s:  # bounds a failure only; no timing is asserted
        if path.exists() and parse_plugin_state(path.read_text()).running[0][3] == 5:
            break
        time.sleep(0.01)
    assert parse_plugin_state(path.read_text()).running[0][3] == 5


def test_vllm_step_shape_reads_prefill_chunks_decodes_and_first_tokens():
    from types import SimpleNamespace

    from predictor.vllm_plugin.publisher import vllm_step_shape

    # After Scheduler.schedule, vLLM has advanced num_computed_tokens by the scheduled tokens.
    def req(prompt, computed_after, outputs):
        return SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=computed_after,
                               num_output_tokens=outputs, num_tokens=prompt + outputs)

    scheduler = SimpleNamespace(requests={
        "decode": req(100, 111, 11),     # 110 of its 111 tokens computed before, computes the last: a decode
        "chunk": req(300, 128, 0),       # first chunk of 128 of a 300-token prompt
        "last": req(300, 300, 0),        # last chunk (172 tokens after 128): its first token comes out
        "resumed": req(50, 40, 5),       # preempted, recomputing 40 of its 55 tokens
    })
    output = SimpleNamespace(num_scheduled_tokens={"decode": 1, "chunk": 128, "last": 172, "resumed": 40,
                                                   "gone": 3})
    shape, first = vllm_step_shape(scheduler, output)
    attention = 128 * 128 + 172 * (128 + 172) + 40 * 40
    assert shape == (1 + 128 + 172 + 40, attention, 111, 5)
    assert first == ["last"]


def test_recorded_steps_and_first_tokens_reach_the_file_and_the_reader(tmp_path):
    path = tmp_path / "state.json"
    publisher = StatePublisher(str(path), 0.0, synchronous=True)
    for i in range(70):
        publisher.record_step(10 + i, 0, 500, 10, 0.005, ["cmpl-a-0"] if i == 3 else (), 100.0 + i)
    publisher.maybe_publish(FakeScheduler([], []))
    state = parse_plugin_state(path.read_text())
    assert [index for index, _ in state.steps] == list(range(39, 71))  # the last STEP_HISTORY (32)
    assert state.steps[-1][1].num_tokens == 79 and state.steps[-1][1].duration_s == 0.005
    assert state.first_tokens == (("cmpl-a-0", 103.0),)


def test_recorded_arrivals_reach_the_file_and_the_reader(tmp_path):
    path = tmp_path / "state.json"
    publisher = StatePublisher(str(path), 0.0, synchronous=True)
    for i in range(70):
        publisher.record_arrival(f"cmpl-{i}-0", 200.0 + i)
    publisher.maybe_publish(FakeScheduler([], []))
    state = parse_plugin_state(path.read_text())
    assert state.arrivals[0] == ("cmpl-6-0", 206.0) and len(state.arrivals) == 64  # the last 64
