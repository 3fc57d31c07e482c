"""Plugin state: reading the file, matching engine ids to admissions, snapshots, and the sidecar's choice."""

import contextlib
import json
import os
import subprocess
import sys
import time

import grpc
import msgpack
import pytest

from predictor.api import pb, pb_grpc
from predictor.kv_events import KvEventIndex
from predictor.server import Sidecar, SidecarConfig
from predictor.sim import EngineConfig, LinearBatchTimeModel
from predictor.sim.block_hash import block_keys
from predictor.sim.predict import predict
from predictor.sim.snapshot import RequestState
from predictor.state_source import (
    UNEXPLAINED_SHARED_KEY_BASE,
    AdmitRecords,
    PluginStateError,
    PluginStateReader,
    PluginStateSource,
    parse_plugin_state,
    plugin_snapshot,
    x_request_id_candidates,
)
from predictor.vllm_plugin.publisher import StatePublisher
from tests.predictor.vllm_plugin.fake_vllm import FakeRequest, FakeSamplingParams, FakeScheduler


def busy_scheduler(num_running: int = 6, num_waiting: int = 4) -> FakeScheduler:
    running = [FakeRequest(f"cmpl-run{i}-0", 120, num_computed_tokens=120 + i, num_output_tokens=i + 1,
                           sampling_params=FakeSamplingParams(max_tokens=200)) for i in range(num_running)]
    waiting = [FakeRequest(f"chatcmpl-wait{i}", 150) for i in range(num_waiting)]
    return FakeScheduler(running, waiting, num_gpu_blocks=129, num_free_blocks=80,
                         blocks={r.request_id: 8 for r in running})


def publish(path, scheduler) -> None:
    StatePublisher(str(path), 0.0, synchronous=True).maybe_publish(scheduler)


@pytest.mark.parametrize("text", ["not json", "{}", json.dumps({"version": 99}), json.dumps({"version": 1})],
                         ids=["garbage", "empty", "other-version", "missing-fields"])
def test_malformed_state_is_rejected(tmp_path, text):
    path = tmp_path / "state.json"
    path.write_text(text)
    reader = PluginStateReader(str(path))
    assert reader.read(time.monotonic()) is None and reader.last_error


def test_reader_rejects_a_missing_file_a_dead_writer_and_a_stale_busy_state(tmp_path):
    path = tmp_path / "state.json"
    reader = PluginStateReader(str(path), max_age_s=5.0)
    assert reader.read(time.monotonic()) is None  # missing
    publish(path, busy_scheduler())
    now_s = time.monotonic()
    assert reader.read(now_s).num_unfinished == 10
    assert reader.read(now_s + 60) is None and "old" in reader.last_error  # busy but not updated for 60 s
    publish(path, busy_scheduler(0, 0))
    assert reader.read(time.monotonic() + 60) is not None  # an idle engine publishes nothing: still valid
    # A state written by a process that has exited.
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    data = json.loads(path.read_text())
    data["pid"] = int(child.stdout)
    path.write_text(json.dumps(data))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    assert reader.read(time.monotonic()) is None and "gone" in reader.last_error


def test_admit_records_match_engine_ids_containing_the_admitted_id():
    records = AdmitRecords(default_output_tokens=100)
    records.admit("abc123", 40)
    assert records.expected_output_tokens("cmpl-abc123-0", None) == 40
    assert records.expected_output_tokens("chatcmpl-abc123", 30) == 30  # capped by max_tokens
    unknown = records.expected_output_tokens("cmpl-other-0", None)
    assert unknown == round(records.mean_output_tokens) and 40 < unknown < 100
    records.admit("other", 7)  # admitted after the engine id was first seen: matched now
    assert records.expected_output_tokens("cmpl-other-0", None) == 7
    records.release("abc123")
    assert records.expected_output_tokens("cmpl-abc123-0", None) == round(records.mean_output_tokens)


def test_admit_records_mean_uses_the_estimate_capped_by_max_tokens():
    records = AdmitRecords(default_output_tokens=100)
    for i in range(10):
        records.admit(f"r{i}", 5000, max_tokens=10)
    assert 10 < records.mean_output_tokens < 100  # towards the 10 tokens priced, not the 5,000 estimated
    assert records.expected_output_tokens("cmpl-r0-0", None) == 10


def test_extproc_ids_match_by_their_x_request_id_part_once_each():
    """The extproc admits ``<x-request-id>/<suffix>``; a client reusing its id sends two such requests."""
    records = AdmitRecords(default_output_tokens=100)
    records.admit("req-7/aaa", 11)
    records.admit("req-7/bbb", 22)
    # vLLM 0.32's engine ids: cmpl-<x-request-id>-<prompt index>-<8 random hex>.
    assert records.expected_output_tokens("cmpl-req-7-0-1a2b3c4d", None) == 11
    assert records.expected_output_tokens("cmpl-req-7-0-5e6f7a8b", None) == 22
    assert records.pending(["cmpl-req-7-0-1a2b3c4d", "cmpl-req-7-0-5e6f7a8b"], now_s=0.0, grace_s=5.0) == []


@pytest.mark.parametrize("engine_id, expected", [
    ("chatcmpl-r1", {"r1"}),
    ("chatcmpl-r1-0a1b2c3d", {"r1", "r1-0a1b2c3d"}),  # vLLM chat with its random suffix
    ("cmpl-r1-0", {"r1", "r1-0"}),  # vLLM completion, prompt 0, randomization off
    ("cmpl-r1-0-0a1b2c3d", {"r1", "r1-0", "r1-0-0a1b2c3d"}),  # vLLM completion
    ("chatcmpl-r1-17", {"r1", "r1-17"}),  # the emulator's counter
    ("chatcmpl-r12-5", {"r12", "r12-5"}),  # not "r1"
    ("embd-r1", set()),
    ("cmpl-", set()),
], ids=["chat-plain", "chat-vllm", "completion-no-suffix", "completion-vllm", "emulator", "longer-id",
        "other-endpoint", "empty"])
def test_engine_ids_name_their_x_request_id_by_shape(engine_id, expected):
    assert x_request_id_candidates(engine_id) == expected


@pytest.mark.parametrize("admitted, engine_id", [
    ("r1", "chatcmpl-r12-5"),  # a prefix of a longer x-request-id
    ("r1", "cmpl-xr1-0"),  # a suffix of one
    ("r1", "chatcmpl-r1x"),
    ("0", "cmpl-r1-0"),  # the prompt index is no x-request-id
    ("r1", "embd-r1"),  # not a chat or completion request
], ids=["prefix", "suffix", "extended", "prompt-index", "other-endpoint"])
def test_admit_records_do_not_match_an_id_that_merely_contains_the_x_request_id(admitted, engine_id):
    records = AdmitRecords(default_output_tokens=100)
    records.admit(f"{admitted}/aaa", 40)
    assert records.expected_output_tokens(engine_id, None) == round(records.mean_output_tokens) != 40  # the mean
    assert [r.request_id for r in records.pending([engine_id], now_s=0.0, grace_s=5.0)] == [f"pending-{admitted}/aaa"]


def test_the_longest_fitting_x_request_id_wins():
    records = AdmitRecords(default_output_tokens=100)
    records.admit("a/1", 10)
    records.admit("a-1/2", 20)
    assert records.expected_output_tokens("chatcmpl-a-1-0123abcd", None) == 20  # "a-1", not "a" + "-1"
    assert records.expected_output_tokens("chatcmpl-a-0123abcd", None) == 10


def test_snapshot_takes_counts_from_the_engine_and_lengths_from_admissions(tmp_path):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler())
    state = parse_plugin_state(path.read_text())
    records = AdmitRecords(default_output_tokens=50)
    records.admit("run2", 90)
    snapshot = plugin_snapshot(state, 10.0, records.expected_output_tokens)
    assert snapshot.config == EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16,
                                           num_gpu_blocks=128)
    assert [r.num_computed_tokens for r in snapshot.running] == [120 + i for i in range(6)]
    assert [r.num_generated_tokens for r in snapshot.running] == [i + 1 for i in range(6)]
    assert snapshot.running[2].num_output_tokens == 90
    assert snapshot.running[0].num_output_tokens == round(records.mean_output_tokens)  # not admitted here
    assert all(r.num_computed_tokens == 0 for r in snapshot.waiting) and len(snapshot.waiting) == 4
    assert snapshot.num_free_blocks == 128 - 6 * 8
    snapshot.to_scheduler()  # a valid state for the simulator


def test_vllm_plugin_source_needs_a_path():
    with pytest.raises(ValueError, match="vllm-state-path"):
        PluginStateSource("vllm-plugin", None)
    with pytest.raises(ValueError, match="state source"):
        PluginStateSource("psychic", None)


@pytest.mark.parametrize("mode, expected", [("auto", "vllm-plugin"), ("vllm-plugin", "vllm-plugin"),
                                            ("ledger", "ledger")])
async def test_sidecar_predicts_from_the_plugin_state_when_present(tmp_path, mode, expected):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler())
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", state_source=mode,
                                    vllm_state_path=str(path), discover_kv_cache=False))
    port = await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.PredictorStub(channel)
    ask = pb.PredictRequest(request_id="x", num_prompt_tokens=100, num_predicted_output_tokens=20)
    try:
        reply = await stub.Predict(ask, timeout=5)
        assert reply.state_source == expected
        if expected == "vllm-plugin":
            assert (reply.num_running, reply.num_waiting, reply.num_gpu_blocks) == (6, 4, 128)
            assert reply.num_free_blocks == 80 and 0 < reply.ttft_s < reply.e2e_s
            state = json.loads((await stub.State(pb.StateRequest(), timeout=5)).state_json)
            assert state["state_source"] == "vllm-plugin" and len(state["running"]) == 6
            path.unlink()  # the engine went away: back to the ledger, which has seen no request
            fallback = await stub.Predict(ask, timeout=5)
            assert fallback.state_source == "ledger" and fallback.num_running + fallback.num_waiting == 0
        else:
            assert reply.num_running + reply.num_waiting == 0
    finally:
        await channel.close()
        await sidecar.stop()


def test_admitted_requests_count_until_the_engine_shows_them(tmp_path):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler(2, 0))
    source = PluginStateSource("vllm-plugin", str(path), max_age_s=3600.0, pending_grace_s=60.0)
    now_s = time.monotonic()
    source.admits.admit("burst1", 30, 80, now_s)
    source.admits.admit("burst2", 30, 80, now_s)
    snapshot = source.snapshot(now_s)
    assert [r.request_id for r in snapshot.waiting] == ["pending-burst1", "pending-burst2"]
    assert snapshot.waiting[0].num_prompt_tokens == 80 and snapshot.waiting[0].num_output_tokens == 30
    # The engine now shows burst1 (vLLM's id embeds the x-request-id): it is no longer counted twice.
    scheduler = busy_scheduler(2, 0)
    scheduler.waiting.append(FakeRequest("cmpl-burst1-0-1a2b3c4d", 80))
    publish(path, scheduler)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    waiting = [r.request_id for r in source.snapshot(now_s).waiting]
    assert waiting == ["cmpl-burst1-0-1a2b3c4d", "pending-burst2"]
    # ... nor after it finished and left the engine; and a pending request expires after the grace period.
    publish(path, busy_scheduler(2, 0))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2_000_000))
    assert [r.request_id for r in source.snapshot(now_s).waiting] == ["pending-burst2"]
    assert source.snapshot(now_s + 61).waiting == ()


def test_admit_records_with_residual_rules_condition_on_progress_and_source():
    from predictor.residual_rules import LENGTH_SOURCE_EXACT, LENGTH_SOURCE_TAGGER, ResidualRules

    rules = ResidualRules()
    records = AdmitRecords(residual=rules)
    records.admit("tag/1", 40, length_source=LENGTH_SOURCE_TAGGER)
    records.admit("ex/1", 40, length_source=LENGTH_SOURCE_EXACT, max_tokens=40)
    # a tagged request 100 tokens past its guess of 40 runs on as replies that long do, not 10 more tokens
    assert records.expected_output_tokens("cmpl-tag-0", None, 140) > 150
    assert records.expected_output_tokens("cmpl-tag-0", 160, 140) <= 160  # the engine's cap wins
    assert records.expected_output_tokens("chatcmpl-ex", None, 10) == 40  # exact: the prediction itself
    # a request nobody admitted here: the reply-length distribution given its progress
    assert records.expected_output_tokens("cmpl-stranger-0", None, 0) == rules.fixed.expected_output_tokens(1, 0)
    assert records.expected_output_tokens("cmpl-stranger-0", None, 500) > 500


def _good_state(path) -> dict:
    publish(path, busy_scheduler())
    return json.loads(path.read_text())


@pytest.mark.parametrize("mutate", [
    lambda d: d["running"].append(["short", 1, 2]),
    lambda d: d["running"].append([None] * 7),
    lambda d: d["running"].append(["x", "abc", 0, 0, None, None, 0]),
    lambda d: d["running"].append(["x", -5, 0, 0, None, None, 0]),
    lambda d: d.update(running={"a": 1}),
    lambda d: d.update(num_free_blocks=10**12),
    lambda d: d.update(pid=2**70),
    lambda d: d.update(pid=0),
    lambda d: d.update(published_monotonic_s="soon"),
    lambda d: d["engine"].update(block_size=-16),
], ids=["short-row", "null-row", "text-count", "negative-count", "running-dict", "huge-free-blocks", "huge-pid",
        "pid-0", "text-time", "negative-block-size"])
def test_every_malformed_field_is_a_state_error_and_the_ledger_takes_over(tmp_path, mutate):
    path = tmp_path / "state.json"
    data = _good_state(path)
    mutate(data)
    path.write_text(json.dumps(data))
    source = PluginStateSource("vllm-plugin", str(path))
    assert source.snapshot(time.monotonic()) is None and source.reader.last_error


def test_unreadable_files_are_refused_without_rereading_them(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    reader = PluginStateReader(str(path))
    assert reader.read(time.monotonic()) is None and "utf-8" in reader.last_error
    os.unlink(path)
    os.mkfifo(path)  # a reader would block on a FIFO forever
    assert reader.read(time.monotonic()) is None and "not a regular file" in reader.last_error
    os.unlink(path)
    data = _good_state(path)
    data["published_monotonic_s"] = time.monotonic() + 3600
    path.write_text(json.dumps(data))
    assert reader.read(time.monotonic()) is None and "future" in reader.last_error


def test_an_idle_engines_state_is_current_however_old(tmp_path):
    path = tmp_path / "state.json"
    data = _good_state(path)
    data.update(running=[], waiting=[], published_monotonic_s=time.monotonic() - 600)
    path.write_text(json.dumps(data))
    state = PluginStateReader(str(path)).read(time.monotonic())
    assert state is not None and state.age_s(time.monotonic()) == 0.0


def test_an_x_request_id_with_a_slash_matches_its_engine_request():
    records = AdmitRecords()
    records.admit("a/b/9f3c", 40)
    assert records.expected_output_tokens("cmpl-a/b-0", None) == 40
    assert records.pending(["cmpl-a/b-0"], 0.0, 2.0) == []  # seen by the engine: not counted twice


async def test_plugin_mode_admit_checks_the_prompt_and_reports_duplicates(tmp_path):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler())
    async with plugin_sidecar(path) as (sidecar, stub):
        reply = await stub.Predict(pb.PredictRequest(request_id="p", num_prompt_tokens=10,
                                                     num_predicted_output_tokens=10))
        assert reply.state_source == "vllm-plugin"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Admit(pb.AdmitRequest(request_id="huge", num_prompt_tokens=2**32 - 1,
                                             num_predicted_output_tokens=1))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "KV blocks" in info.value.details()
        # a long guess is admitted (the snapshot cuts it to the KV cache) and predictions keep working
        first = await stub.Admit(pb.AdmitRequest(request_id="long/1", num_prompt_tokens=100,
                                                 num_predicted_output_tokens=2**31))
        again = await stub.Admit(pb.AdmitRequest(request_id="long/1", num_prompt_tokens=100,
                                                 num_predicted_output_tokens=2**31))
        assert (first.duplicate, again.duplicate) == (False, True)
        reply = await stub.Predict(pb.PredictRequest(request_id="p", num_prompt_tokens=10,
                                                     num_predicted_output_tokens=10))
        assert reply.ttft_s > 0 and reply.e2e_s >= reply.ttft_s and reply.queue_s >= 0


@contextlib.asynccontextmanager
async def plugin_sidecar(path, **config):
    """A sidecar in plugin mode reading the state file ``path`` (no backend, no KV-cache discovery; ``config``:
    more `SidecarConfig` fields), started, and a stub on it: ``(sidecar, stub)``; stopped on exit."""
    sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", state_source="vllm-plugin",
                                    vllm_state_path=str(path), discover_kv_cache=False, **config))
    await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            yield sidecar, pb_grpc.PredictorStub(channel)
    finally:
        await sidecar.stop(0)


def _state_text(**extra) -> str:
    base = {"version": 1, "pid": os.getpid(), "seq": 1, "published_monotonic_s": time.monotonic(),
            "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16, "num_gpu_blocks": 64,
                       "enable_chunked_prefill": True},
            "num_free_blocks": 64, "num_preemptions_total": 0, "running": [], "waiting": []}
    return json.dumps({**base, **extra})


@pytest.mark.parametrize("extra", [
    {"steps": {}}, {"steps": [[1, 2, 3, 4]]}, {"steps": [[1, 10, 0, 100, 2, -0.1]]},
    {"steps": [[1, 10, 0, 100, 2, "fast"]]}, {"steps": [[-1, 10, 0, 100, 2, 0.01]]},
    {"first_tokens": [["", 1.0]]}, {"first_tokens": [["a", None]]}, {"first_tokens": "a"}],
    ids=["steps-object", "short-row", "negative-duration", "text-duration", "negative-index", "empty-id",
         "no-time", "not-a-list"])
def test_malformed_steps_or_first_tokens_are_rejected(extra):
    with pytest.raises(PluginStateError):
        parse_plugin_state(_state_text(**extra))


def test_a_state_without_steps_is_valid_and_new_steps_are_taken_once():
    assert parse_plugin_state(_state_text()).steps == ()
    source = PluginStateSource("auto", None)
    first = parse_plugin_state(_state_text(steps=[[1, 10, 0, 100, 2, 0.01], [2, 11, 0, 100, 2, 0.01]]))
    assert [s.num_tokens for s in source.new_steps(first)] == [10, 11]
    second = parse_plugin_state(_state_text(steps=[[2, 11, 0, 100, 2, 0.01], [3, 12, 0, 100, 2, 0.01]]))
    assert [s.num_tokens for s in source.new_steps(second)] == [12]  # step 2 was taken already
    assert source.new_steps(second) == []
    restarted = parse_plugin_state(_state_text(pid=1, steps=[[1, 20, 0, 100, 2, 0.01]]))  # a new engine process
    assert [s.num_tokens for s in source.new_steps(restarted)] == [20]


@pytest.mark.parametrize("extra", [
    {"steps": [[1, 10, 0, 100, 2, 10**400]]}, {"first_tokens": [["a", 10**400]]},
    {"published_monotonic_s": 10**400}, {"steps": [[i + 1, 10, 0, 100, 2, 0.01] for i in range(5000)]}],
    ids=["huge-duration", "huge-first-token-time", "huge-publish-time", "too-many-steps"])
def test_huge_numbers_and_huge_lists_in_the_state_file_are_refused(extra):
    with pytest.raises(PluginStateError):
        parse_plugin_state(_state_text(**extra))


def test_plugin_snapshot_carries_admitted_keys_and_the_engines_cached_free_blocks(tmp_path):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler(2, 1))  # running cmpl-run0-0 / cmpl-run1-0 (120 prompt tokens), waiting chatcmpl-wait0
    source = PluginStateSource("vllm-plugin", str(path), max_age_s=3600.0, pending_grace_s=60.0,
                               kv_index=KvEventIndex(16))
    now_s = time.monotonic()
    run_keys = tuple(range(1000, 1010))  # more than the engine's 120-token prompt has full blocks (7): cut
    source.admits.admit("run0", 30, 120, now_s, block_keys=run_keys)
    source.admits.admit("wait0", 30, 150, now_s)
    source.admits.add_block_keys("wait0", (1000, 1001, 2002))
    tokens = list(range(64))
    source.kv_index.on_message(0, msgpack.packb([0.0, [
        {"type": "BlockStored", "block_hashes": [1, 2, 3, 4], "parent_block_hash": None, "token_ids": tokens,
         "block_size": 16}]]))
    snapshot = source.snapshot(now_s)
    run0, run1 = snapshot.running
    assert run0.block_keys == run_keys[:7] and run1.block_keys is None
    assert snapshot.waiting[0].block_keys == (1000, 1001, 2002)
    assert snapshot.cached_block_keys == block_keys(tokens, 16)[::-1]  # a chain's tail evicted first
    snapshot.to_scheduler()
    # keys a running request holds are not free: they are left out of the cached free blocks
    assert plugin_snapshot(parse_plugin_state(path.read_text()), now_s, source.admits.expected_output_tokens,
                           lambda rid: block_keys(tokens, 16) if rid == "cmpl-run0-0" else None,
                           block_keys(tokens, 16)).cached_block_keys == ()


def test_a_sidecar_prices_a_hit_on_the_blocks_the_engines_kv_events_report(tmp_path):
    """Plugin mode with --kv-events-endpoint: a real ZMQ publisher reports a cached prompt; a Predict for that prompt
    answers a shorter TTFT with its keys than without (through the real gRPC server)."""
    import asyncio

    import zmq
    import zmq.asyncio

    path = tmp_path / "state.json"
    publish(path, busy_scheduler(0, 0))
    tokens = [7 + (i % 50) for i in range(1024)]  # 64 of the plugin state's 128 KV blocks
    keys = block_keys(tokens, 16)

    async def scenario():
        pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sidecar = Sidecar(SidecarConfig(backend="127.0.0.1:1", listen="127.0.0.1:0", state_source="vllm-plugin",
                                        vllm_state_path=str(path), plugin_max_age_s=3600.0,
                                        engine=EngineConfig(num_gpu_blocks=128 * 16), calibration="off",
                                        kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kv"))
        sidecar_port = await sidecar.start()
        try:
            batch = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": list(range(1, len(keys) + 1)),
                                         "parent_block_hash": None, "token_ids": tokens, "block_size": 16}]])
            for seq in range(300):  # until the SUB socket has joined (it misses what comes before)
                await pub.send_multipart((b"kv", seq.to_bytes(8, "big"), msgpack.packb([0.0, []])))
                await asyncio.sleep(0.01)
                if sidecar.kv_index.counts.batches:
                    break
            await pub.send_multipart((b"kv", (seq + 1).to_bytes(8, "big"), batch))
            for _ in range(300):
                await asyncio.sleep(0.01)
                if sidecar.kv_index.num_blocks == len(keys):
                    break
            async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar_port}") as channel:
                stub = pb_grpc.PredictorStub(channel)
                common = dict(num_prompt_tokens=len(tokens) + 5, num_predicted_output_tokens=20)
                cold = await stub.Predict(pb.PredictRequest(request_id="a", **common))
                warm = await stub.Predict(pb.PredictRequest(request_id="b", block_keys=keys,
                                                            block_keys_block_size=16, **common))
                other = await stub.Predict(pb.PredictRequest(request_id="c", block_keys=block_keys(
                    [t + 1 for t in tokens], 16), block_keys_block_size=16, **common))
            return cold, warm, other
        finally:
            await sidecar.stop(0)
            pub.close(linger=0)

    cold, warm, other = asyncio.run(scenario())
    assert warm.ttft_s < 0.5 * cold.ttft_s
    assert other.ttft_s == pytest.approx(cold.ttft_s, rel=0.05)


def test_without_kv_events_released_prompts_approximate_the_cached_free_blocks(tmp_path):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler(0, 0))  # 80 free blocks
    source = PluginStateSource("vllm-plugin", str(path), max_age_s=3600.0)
    now_s = time.monotonic()
    source.admits.admit("a", 10, 64, now_s, block_keys=(1, 2, 3, 4))
    source.admits.admit("b", 10, 32, now_s, block_keys=(1, 5))
    source.admits.release("a")
    source.admits.release("b")
    # each request's blocks tail first; b's shared first block freed again after a's: a chain's tail before its head
    assert source.snapshot(now_s).cached_block_keys == (4, 3, 2, 5, 1)
    assert source.admits.freed_keys(2) == (5, 1)  # the engine can keep only its free blocks' worth
    source.snapshot(now_s).to_scheduler()


def test_cached_keys_never_exceed_the_free_blocks(tmp_path):
    path = tmp_path / "state.json"
    publish(path, busy_scheduler(6, 0))  # 128 blocks, 48 held by the running requests
    state = parse_plugin_state(path.read_text())
    cached = tuple(range(10_000, 10_200))  # an index holding more than is free (other routers', decode blocks)
    snapshot = plugin_snapshot(state, 0.0, lambda *_: 10, None, cached)
    assert snapshot.cached_block_keys == cached[-80:]
    snapshot.to_scheduler()


@pytest.mark.parametrize("compiled", [True, False])
def test_running_requests_sharing_blocks_no_key_explains_still_predict(compiled):
    """Four running requests share a 320-token prompt (20 full blocks) on an engine of 64 blocks: their rows hold
    4 x 21 = 84 blocks, the engine 24 (40 free). No Admit gave usable keys (e.g. the router hashed 16-token blocks
    for an engine of 32): the snapshot names a synthetic shared prefix, so the simulator holds what the engine holds
    instead of refusing the state ("84 blocks wanted, 64 free") and every Predict with it."""
    rows = [[f"r{i}", 320, 324, 4, 64, None, 0] for i in range(4)]
    state = parse_plugin_state(_state_text(running=rows, num_free_blocks=40))
    snapshot = plugin_snapshot(state, 0.0, lambda *_: 40)
    assert all(r.block_keys == tuple(range(UNEXPLAINED_SHARED_KEY_BASE, UNEXPLAINED_SHARED_KEY_BASE + 20))
               for r in snapshot.running)
    assert snapshot.to_scheduler().num_free_blocks == 40
    target = RequestState("new", 100, 10, block_keys=(1, 2, 3))
    assert predict(snapshot, target, LinearBatchTimeModel.default(), compiled=compiled).ttft_s > 0
    # where the keys explain the sharing, or the blocks fit, nothing is invented
    keyed = plugin_snapshot(state, 0.0, lambda *_: 40, lambda _: tuple(range(100, 120)))
    assert all(r.block_keys == tuple(range(100, 120)) for r in keyed.running)
    few = parse_plugin_state(_state_text(running=rows[:3], num_free_blocks=1))
    assert all(r.block_keys is None for r in plugin_snapshot(few, 0.0, lambda *_: 40).running)
    # sharing only part of the prompt: the smallest synthetic prefix that gives the engine's count
    partial = parse_plugin_state(_state_text(running=rows, num_free_blocks=10))  # 54 in use: 10 shared
    snapshot = plugin_snapshot(partial, 0.0, lambda *_: 40)
    assert {len(r.block_keys) for r in snapshot.running} == {10}
    assert snapshot.to_scheduler().num_free_blocks == 10
    # sharing nothing can explain (decode blocks beyond the pool): left as it is, and the simulator says why
    hopeless = parse_plugin_state(_state_text(running=[[f"d{i}", 8, 330, 322, None, None, 0] for i in range(4)],
                                              num_free_blocks=0))
    with pytest.raises(ValueError, match="blocks wanted"):
        plugin_snapshot(hopeless, 0.0, lambda *_: 400).to_scheduler()


def test_a_hostile_state_is_not_walked_block_by_block():
    """Two keyless running requests claiming ~2^31 computed tokens (the reader's bound): the synthetic prefix is
    computed in closed form (no loop over 2^27 blocks), finds nothing that fits the pool, and leaves the state for
    the simulator to refuse."""
    rows = [[f"h{i}", 2**31 - 2, 2**31 - 2, 1, None, None, 0] for i in range(2)]
    state = parse_plugin_state(_state_text(running=rows, num_free_blocks=0))
    start_s = time.monotonic()
    snapshot = plugin_snapshot(state, 0.0, lambda *_: 2)
    assert time.monotonic() - start_s < 1.0
    assert all(r.block_keys is None for r in snapshot.running)
