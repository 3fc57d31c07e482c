"""bench.streams: the pure parts; and bench.fast_backend's streaming and delay modes, which only that bench uses
(pure helpers, then one real backend process: a second or two)."""

import asyncio
import json
import math
import sys
from collections import Counter

import aiohttp
import pytest

from bench import streams as bs
from bench.fast_backend import (DELAY_HEADER, DONE_EVENT, INSTANCE_HEADER, TOKEN_INTERVAL_HEADER, metrics_text,
                                sse_chunk, stream_tokens)
from astrolabe.procs import ProcessGroup, free_port
from predictor.backend_metrics import parse_vllm_metrics
from tests.integration.stack import poll_until

STATUS = "Name:\tpython\nVmPeak:\t  200000 kB\nVmRSS:\t   12345 kB\nThreads:\t4\n"


@pytest.mark.parametrize(("text", "expected"), [(STATUS, 12345 * 1024), ("Name:\tzombie\nState:\tZ\n", 0)],
                         ids=["live", "zombie-has-no-rss"])
def test_vm_rss_is_read_in_bytes(text, expected):
    assert bs.vm_rss_bytes(text) == expected


def test_group_rss_of_this_process_group_is_at_least_this_process():
    import os  # noqa: PLC0415

    own = bs.vm_rss_bytes(open(f"/proc/{os.getpid()}/status").read())
    assert bs.group_rss_bytes(os.getpgrp()) >= own > 0


@pytest.mark.parametrize(("idle", "open_", "num_open", "expected"),
                         [(0, 2048 * 1000, 1000, 2.0), (1024, 1024, 10, 0.0), (4096, 2048, 2, -1.0)],
                         ids=["grows", "flat", "shrinks"])
def test_per_stream_kib(idle, open_, num_open, expected):
    assert bs.per_stream_kib(idle, open_, num_open) == expected


def test_per_stream_kib_of_nothing_open_is_nan():
    assert math.isnan(bs.per_stream_kib(0, 100, 0))


@pytest.mark.parametrize(("status", "chunks", "done", "outcome"),
                         [(200, 20, True, "ok"), (200, 19, True, "short"), (200, 20, False, "short"),
                          (200, 21, True, "long"), (503, 0, False, "status 503"), (504, 20, True, "status 504")],
                         ids=["whole", "a-chunk-missing", "no-done", "too-many", "refused", "status-wins"])
def test_stream_outcome(status, chunks, done, outcome):
    assert bs.stream_outcome(status, chunks, done, 20) == outcome


@pytest.mark.parametrize(("args", "num_problems", "says"),
                         [((2000, 20, 1.0, 250.0, 20000), 0, ""),
                          ((2000, 5, 1.0, 250.0, 20000), 1, "first end before the last open"),
                          ((2000, 20, 1.0, 250.0, 4096), 1, "ulimit -n"),
                          ((10000, 2, 0.0, 10.0, 1024), 2, "")],
                         ids=["fits", "streams-shorter-than-ramp", "few-descriptors", "both"])
def test_plan_check(args, num_problems, says):
    problems = bs.plan_check(*args)
    assert len(problems) == num_problems
    assert says in " ".join(problems)


def test_envoy_stats_reads_the_named_lines_only():
    text = ("cluster.extproc.upstream_cx_active: 2\ncluster.extproc.upstream_rq_active: 2000\n"
            "cluster.other.upstream_cx_active: 9\nhttp.astrolabe_ingress.downstream_cx_length_ms: P0(nan,1)\n")
    assert bs.envoy_stats(text) == {"cluster.extproc.upstream_cx_active": 2, "cluster.extproc.upstream_rq_active": 2000}


def test_result_figures_per_stream_and_left_behind():
    mib = 2**20
    result = bs.ScaleResult(1000, 20, 1.0, "full-duplex", "astrolabe", idle=bs.Memory(100 * mib, 50 * mib))
    result.rounds = [bs.Round(Counter(ok=1000), bs.Memory(130 * mib, 150 * mib), 1000, 4.0, {},
                              bs.Memory(120 * mib, 150 * mib), tasks_after=210),
                     bs.Round(Counter(ok=999, short=1), bs.Memory(131 * mib, 150 * mib), 1000, 4.0, {},
                              bs.Memory(121 * mib, 150 * mib), tasks_after=1210)]
    assert result.num_ok == 1999
    assert result.kib_per_stream("extproc") == pytest.approx(30 * 1024 / 1000)
    assert result.kib_per_stream("envoy", 1) == pytest.approx(100 * 1024 / 1000)
    assert result.growth_kib_per_stream("extproc") == pytest.approx(1024 / 1000)
    assert result.growth_kib_per_stream("envoy") == 0
    assert result.tasks_left_per_stream == 1.0
    text = bs.format_report(result)
    assert "r2 KiB / open stream" in text and "short" in text and "30.7" in text
    assert "after each round 210, 1210: 1.000 left behind per stream" in text


def test_one_round_has_no_left_behind_figure_and_no_samples_give_nan():
    result = bs.ScaleResult(10, 2, 0.0, "buffered", "least-requests", rounds=[bs.Round()])
    assert math.isnan(result.kib_per_stream("extproc")) and math.isnan(result.growth_kib_per_stream("envoy"))
    assert math.isnan(result.tasks_left_per_stream)
    assert "extproc still up: NO" in bs.format_report(result)


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--tokens", "1"], ["--open-rate", "0"], ["--rounds", "0"],
                                  ["--long-s", "-1"], ["--policy", "gie"]],
                         ids=["no-streams", "one-token", "no-rate", "no-rounds", "negative-long", "unknown-policy"])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as exc:
        bs._parse_args(argv)
    assert exc.value.code == 2


def test_run_refuses_bad_arguments_before_starting_anything():
    with pytest.raises(ValueError, match="body_mode"):
        bs.run(10, body_mode="streamed")


# --- bench.fast_backend ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "expected"),
                         [(b'{"stream": true, "max_tokens": 7}', 7), (b'{"stream": true, "max_completion_tokens": 3}', 3),
                          (b'{"stream": true}', 16), (b'{"stream": true, "max_tokens": 0}', 16),
                          (b'{"stream": false, "max_tokens": 7}', None), (b'{"max_tokens": 7}', None),
                          (b'{"messages": [{"content": "say \\"stream\\": true"}]}', None), (b'"stream"', None),
                          (b'{"stream": true, "max_tokens": true}', 16), (b'not json "stream"', None)],
                         ids=["max-tokens", "max-completion-tokens", "default", "zero-is-default", "not-streamed",
                              "no-stream-key", "stream-in-content", "not-an-object", "bool-is-not-a-count", "bad-json"])
def test_stream_tokens(body, expected):
    assert stream_tokens(body, 16) == expected


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "text"])
def test_sse_chunk_is_one_openai_event(chat):
    event = sse_chunk(chat, "length")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    choice = json.loads(event[len(b"data: "):])["choices"][0]
    assert choice["finish_reason"] == "length"
    assert (choice["delta"]["content"] if chat else choice["text"]) == "ok "


def test_metrics_text_is_read_by_the_sidecars_own_parser():
    assert parse_vllm_metrics(metrics_text(5, 16384, 16)).num_running == 5


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    port = free_port()
    with ProcessGroup() as procs:
        proc = procs.start([sys.executable, "-m", "bench.fast_backend", "--port", str(port), "--tokens", "3",
                            "--token-interval-s", "30"], name="fast", log_path=tmp_path_factory.mktemp("fast") / "log")
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=30)
        yield f"http://127.0.0.1:{port}"


async def _post(url: str, body: dict, headers: dict) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
        return response.status, await response.read(), dict(response.headers)


def _running(url: str) -> int:
    import urllib.request  # noqa: PLC0415

    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/metrics", timeout=5) as r:
        return parse_vllm_metrics(r.read().decode()).num_running


def test_a_streamed_request_gets_its_chunks_then_done(backend):
    status, body, headers = asyncio.run(_post(f"{backend}/v1/chat/completions", {"stream": True, "max_tokens": 4},
                                              {TOKEN_INTERVAL_HEADER: "0"}))
    events = body.split(b"\n\n")
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream") and INSTANCE_HEADER in headers
    assert events[-2:] == [DONE_EVENT[:-2], b""]
    assert [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]] == [None, None, None, "length"]


def test_the_default_stream_length_and_text_completions(backend):
    _, body, _ = asyncio.run(_post(f"{backend}/v1/completions", {"stream": True}, {TOKEN_INTERVAL_HEADER: "0"}))
    assert body.count(b'"object":"text_completion"') == 3 and body.endswith(DONE_EVENT)


def test_a_plain_request_is_answered_at_once_as_before(backend):
    status, body, _ = asyncio.run(_post(f"{backend}/v1/chat/completions", {"max_tokens": 50}, {}))
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 1


def test_a_bad_header_is_a_400(backend):
    status, body, _ = asyncio.run(_post(f"{backend}/v1/chat/completions", {}, {DELAY_HEADER: "-1"}))
    assert status == 400 and DELAY_HEADER.encode() in body


def test_open_requests_are_counted_running_until_they_end(backend):
    """A delayed plain request and a stream paused between chunks both count in vllm:num_requests_running."""

    async def both() -> tuple:
        silent = asyncio.ensure_future(_post(f"{backend}/v1/chat/completions", {}, {DELAY_HEADER: "1.5"}))
        streamed = asyncio.ensure_future(_post(f"{backend}/v1/chat/completions", {"stream": True, "max_tokens": 2},
                                               {TOKEN_INTERVAL_HEADER: "1.5"}))
        await asyncio.to_thread(poll_until, lambda: _running(backend) == 2, 10, "both requests running")
        return tuple(await asyncio.gather(silent, streamed))

    (silent_status, silent_body, _), (_, streamed_body, _) = asyncio.run(both())
    assert silent_status == 200 and json.loads(silent_body)["object"] == "chat.completion"
    assert streamed_body.count(b"data: ") == 3
    poll_until(lambda: _running(backend) == 0, 10, "nothing running")  # raises TimeoutError if one still counts
