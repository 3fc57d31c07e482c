"""Replay of a request trace (open loop) or of chat sessions (closed loop) against an OpenAI-compatible endpoint
(Envoy in the demo).

Owns: sending each :class:`bench.workloads.TraceRequest` at its arrival offset as a streaming
``POST /v1/chat/completions`` (`replay`), replaying recorded conversations turn by turn (`ChatSession`,
`replay_sessions`), timing each request, and reporting one :class:`RequestResult` per request. Must not start
processes or import gRPC.

NOTE: `replay`'s arrivals are open-loop (a slow server does not delay later sends); `replay_sessions` is
closed-loop within a session (a turn waits for the previous reply) and open-loop across sessions. All times are taken on
``time.monotonic()`` in this process, so they include Envoy and extproc overhead. TTFT is the time from sending the
request to the first SSE event that carries content; E2E is the time to ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Sequence

import aiohttp
from tqdm import tqdm

from bench.workloads import TraceRequest

logger = logging.getLogger(__name__)

INSTANCE_HEADER = "x-emulator-instance"
"""Response header in which the emulator names itself (``host:port``)."""

OUTPUT_TOKENS_HEADER = "x-emulator-output-tokens"
"""Request header telling the emulator the reply's length (``bench.emulator.server.OUTPUT_TOKENS_HEADER``)."""

OBJECTIVE_HEADER = "x-gateway-inference-objective"
"""Request header naming the request's objective (the Gateway API Inference Extension's; ``TraceRequest.objective``,
read by ``extproc.admission``)."""

DROP_REASON_HEADER = "x-astrolabe-drop-reason"
"""Response header of a request the router refused (429): why (``extproc.admission.SHED_REASONS``)."""

CHAT_PATH = "/v1/chat/completions"
_DONE = b"[DONE]"
_MAX_ERROR_CHARS = 300


@dataclasses.dataclass(slots=True)
class RequestResult:
    """Outcome of one replayed request.

    Attributes:
        id: the trace request's id.
        num_prompt_tokens: prompt tokens (trace value, ``tagger.tokenizer``).
        max_tokens: the reply's expected length, tokens (``expected_completion_tokens``).
        send_offset_s: when it was sent, seconds after the replay started (monotonic clock).
        status: HTTP status, or None if no response arrived.
        instance: value of the ``x-emulator-instance`` response header, or None if absent.
        ttft_s: seconds from send to the first content event, or None if none arrived.
        e2e_s: seconds from send to ``[DONE]``, or None if the stream did not finish.
        num_completion_tokens: ``usage.completion_tokens`` of the final chunk, or None if absent.
        error: why the request failed, or None if it succeeded or was refused.
        drop_reason: the router refused it (429 with the ``x-astrolabe-drop-reason`` header: admission's shed
            path): that header's value; None otherwise. A refusal is not an error: the router did what it was
            configured to do.
    """

    id: str
    num_prompt_tokens: int
    max_tokens: int
    send_offset_s: float
    status: int | None = None
    instance: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_completion_tokens: int | None = None
    error: str | None = None
    drop_reason: str | None = None

    @property
    def ok(self) -> bool:
        """True when the request was served (no error recorded, not refused)."""
        return self.error is None and self.drop_reason is None

    @property
    def refused(self) -> bool:
        """True when the router refused it (429 with a drop reason)."""
        return self.drop_reason is not None


def chat_body(model: str, request: TraceRequest, system_prompt: str | None = None) -> dict[str, object]:
    """The JSON body sent for ``request``: a streaming chat completion capped at ``request.max_tokens``, or of
    exactly ``num_output_tokens`` tokens (``ignore_eos``) when the trace sets no cap; ``system_prompt`` (if any)
    is a system message before the prompt."""
    body = _streaming_chat(model, [*_system_messages(system_prompt), {"role": "user", "content": request.prompt}],
                           request.num_output_tokens if request.max_tokens is None else request.max_tokens)
    if request.max_tokens is None:
        body["ignore_eos"] = True
    return body


def _streaming_chat(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
    """A streaming chat completion body whose last event reports the usage (``stream_options.include_usage``)."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}


def _system_messages(system_prompt: str | None) -> list[dict[str, str]]:
    """``[the system message]``, or ``[]`` without a system prompt."""
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def expected_completion_tokens(request: TraceRequest) -> int:
    """Output tokens the reply must have."""
    if request.max_tokens is None:
        return request.num_output_tokens
    return min(request.num_output_tokens, request.max_tokens)


def request_headers(request: TraceRequest) -> dict[str, str]:
    """The request id, the reply's length for the emulator (with a ``max_tokens`` cap) and the objective's name
    (if any)."""
    headers = {"x-request-id": request.id}
    if request.max_tokens is not None:
        headers[OUTPUT_TOKENS_HEADER] = str(request.num_output_tokens)
    if request.objective is not None:
        headers[OBJECTIVE_HEADER] = request.objective
    return headers


def _has_content(event: dict) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


async def _read_stream(resp: aiohttp.ClientResponse, result: RequestResult, sent_s: float) -> None:
    """Consume an SSE body, filling ttft_s, e2e_s and num_completion_tokens of ``result``."""
    async for raw_line in resp.content:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == _DONE:
            result.e2e_s = time.monotonic() - sent_s
            return
        # Decoding every event costs CPU the emulators need; after the first token only the usage chunk matters.
        if result.ttft_s is not None and b'"usage"' not in data:
            continue
        event = json.loads(data)
        if result.ttft_s is None and _has_content(event):
            result.ttft_s = time.monotonic() - sent_s
        usage = event.get("usage")
        if usage:
            result.num_completion_tokens = usage.get("completion_tokens")


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: TraceRequest,
    replay_start_s: float,
    request_timeout_s: float,
    system_prompt: str | None = None,
) -> RequestResult:
    """Send one streaming chat completion and time it; never raises for request failures.

    Args:
        session: shared client session.
        url: full URL of the chat completions endpoint.
        model: served model name.
        request: the trace request.
        replay_start_s: ``time.monotonic()`` at the start of the replay, for ``send_offset_s``.
        request_timeout_s: limit on the whole request (headers and stream), seconds.
        system_prompt: a system message before the prompt (None: none).

    Returns:
        The result; ``drop_reason`` is set if the router refused it (429 with ``x-astrolabe-drop-reason``);
        ``error`` is set if the status is otherwise not 200, the stream broke or timed out, or
        ``usage.completion_tokens`` differs from ``max_tokens``.
    """
    sent_s = time.monotonic()
    result = RequestResult(request.id, request.num_prompt_tokens, expected_completion_tokens(request),
                           sent_s - replay_start_s)
    await _post_chat(session, url, chat_body(model, request, system_prompt), request_headers(request), result, sent_s,
                     request_timeout_s)
    return result


async def _post_chat(session: aiohttp.ClientSession, url: str, body: dict[str, object], headers: dict[str, str],
                     result: RequestResult, sent_s: float, request_timeout_s: float) -> None:
    """POST one streaming chat completion and fill ``result`` (status, instance, times, error); never raises for
    request failures. ``result.max_tokens`` is the reply length the stream must report."""
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as resp:
            result.status = resp.status
            result.instance = resp.headers.get(INSTANCE_HEADER)
            if resp.status != 200:
                text = await resp.text(errors="replace")
                if resp.status == 429 and DROP_REASON_HEADER in resp.headers:
                    result.drop_reason = resp.headers[DROP_REASON_HEADER]  # refused by admission: not an error
                else:
                    result.error = f"HTTP {resp.status}: {text[:_MAX_ERROR_CHARS]}"
                return
            await _read_stream(resp, result, sent_s)
    except asyncio.TimeoutError:
        result.error = f"timed out after {request_timeout_s:g} s"
        return
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        return
    if result.e2e_s is None:
        result.error = "stream ended before [DONE]"
    elif result.num_completion_tokens != result.max_tokens:
        result.error = f"usage.completion_tokens={result.num_completion_tokens}, expected {result.max_tokens}"


async def _finish_by(tasks: list[asyncio.Task], deadline_s: float) -> None:
    """Waits for ``tasks`` until ``deadline_s`` (``time.monotonic()`` seconds), cancels those still running, and
    waits for all to end (their exceptions stay in the tasks)."""
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, deadline_s - time.monotonic()))
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def replay(
    base_url: str | Sequence[str],
    trace: Sequence[TraceRequest],
    *,
    model: str,
    request_timeout_s: float = 120.0,
    overall_timeout_s: float = 600.0,
    progress: bool = True,
    progress_desc: str = "requests",
    system_prompt: str | None = None,
) -> list[RequestResult]:
    """Send every request of ``trace`` at its arrival offset and wait for all of them.

    Args:
        base_url: scheme, host and port, e.g. ``"http://127.0.0.1:10000"``; or one per router replica, each
            request going to ``base_url[request.router % len(base_url)]``.
        trace: requests in arrival order.
        model: served model name put in each body.
        request_timeout_s: limit per request, seconds.
        overall_timeout_s: limit on the whole replay from its start, seconds; requests still open then are
            cancelled and reported with an error, and requests not yet sent are reported unsent.
        progress: show a tqdm bar of completed requests (on stderr, when it is a terminal).
        progress_desc: label of the bar.
        system_prompt: a system message put before every request's prompt (None: none).

    Returns:
        One result per trace request, trace order.
    """
    urls = [u.rstrip("/") + CHAT_PATH for u in ([base_url] if isinstance(base_url, str) else base_url)]
    # limit=0: one connection per in-flight request, as many as the trace needs (open loop).
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    bar = tqdm(total=len(trace), desc=progress_desc, unit="req", disable=None if progress else True, leave=True)
    tasks: list[asyncio.Task[RequestResult]] = []
    start_s = time.monotonic()
    deadline_s = start_s + overall_timeout_s
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            for request in trace:
                delay_s = start_s + request.arrival_offset_s - time.monotonic()
                if start_s + request.arrival_offset_s > deadline_s:
                    break
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
                task = asyncio.create_task(
                    send_request(session, urls[request.router % len(urls)], model, request, start_s,
                                 request_timeout_s, system_prompt)
                )
                task.add_done_callback(lambda _t: bar.update(1))
                tasks.append(task)
            await _finish_by(tasks, deadline_s)
    finally:
        bar.close()
    return [_result_of(task, request, start_s, overall_timeout_s) for task, request in _pad(tasks, trace)]


REPLY_TEXT_FIELD = "emulator_reply_text"
"""Body field naming the reply the emulator must generate token for token (``bench.emulator.openai_api``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChatTurn:
    """One turn of a recorded chat session.

    Attributes:
        user: the human message.
        reply: the recorded reply's text (the emulator generates exactly its tokens, `REPLY_TEXT_FIELD`).
        num_prompt_tokens: the turn's prompt, tokens (the messages' own tokens, ``tagger.tokenizer``: the
            conversation so far plus ``user``; the chat template's few tokens are not counted).
        num_output_tokens: the reply's tokens (same tokenizer).
    """

    user: str
    reply: str
    num_prompt_tokens: int
    num_output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class ChatSession:
    """A recorded conversation replayed as a closed-loop chat session.

    Attributes:
        id: unique within the replay; its turns' results are ``"<id>/<k>"`` (k from 0).
        start_offset_s: when turn 0 is sent, seconds after the replay starts.
        turns: the turns, in order (>= 1).
        think_times_s: one per gap between turns: turn k + 1 is sent this long after turn k's reply ended.
        router: which router replica (base URL) every turn goes to (a client keeps its connection's gateway).
    """

    id: str
    start_offset_s: float
    turns: tuple[ChatTurn, ...]
    think_times_s: tuple[float, ...]
    router: int = 0

    def __post_init__(self) -> None:
        if not self.turns or len(self.think_times_s) != len(self.turns) - 1:
            raise ValueError(f"session {self.id}: {len(self.turns)} turns need {len(self.turns) - 1} think times, "
                             f"got {len(self.think_times_s)}")


def session_messages(session: ChatSession, turn: int, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The messages of ``session``'s turn ``turn``: the optional system message, every earlier (user, recorded
    reply) pair, then the turn's user message."""
    messages = _system_messages(system_prompt)
    for t in session.turns[:turn]:
        messages += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.reply}]
    messages.append({"role": "user", "content": session.turns[turn].user})
    return messages


async def _replay_session(http: aiohttp.ClientSession, url: str, model: str, chat: ChatSession, start_s: float,
                          deadline_s: float, request_timeout_s: float, system_prompt: str | None,
                          on_done: object) -> list[RequestResult]:
    results: list[RequestResult] = []
    send_at_s = start_s + chat.start_offset_s
    for k, turn in enumerate(chat.turns):
        result = RequestResult(f"{chat.id}/{k}", turn.num_prompt_tokens, turn.num_output_tokens,
                               send_at_s - start_s)
        if results and not results[-1].ok:
            result.error = "not sent: an earlier turn of its session failed"
        elif send_at_s > deadline_s:
            result.error = "not sent: overall timeout"
        else:
            await asyncio.sleep(max(0.0, send_at_s - time.monotonic()))
            body = {**_streaming_chat(model, session_messages(chat, k, system_prompt), turn.num_output_tokens),
                    REPLY_TEXT_FIELD: turn.reply}
            sent_s = time.monotonic()
            result.send_offset_s = sent_s - start_s
            await _post_chat(http, url, body, {"x-request-id": result.id}, result, sent_s, request_timeout_s)
            if k + 1 < len(chat.turns):
                send_at_s = time.monotonic() + chat.think_times_s[k]
        results.append(result)
        on_done()  # type: ignore[operator]
    return results


async def replay_sessions(
    base_url: str | Sequence[str],
    sessions: Sequence[ChatSession],
    *,
    model: str,
    system_prompt: str | None = None,
    request_timeout_s: float = 120.0,
    overall_timeout_s: float = 600.0,
    progress: bool = True,
    progress_desc: str = "turns",
) -> list[RequestResult]:
    """Replay chat sessions closed-loop: each session sends turn 0 at its start offset as a streaming chat
    completion; a think time after a reply ends it sends the next turn, whose messages are the conversation so far
    (the recorded replies, which the emulator generates token for token through `REPLY_TEXT_FIELD`, so the turn's
    prompt can hit the blocks of the previous reply as on a real chat) plus the next user message.

    Args:
        base_url: scheme, host and port, or one per router replica (``session.router`` indexes them).
        sessions: sessions, in start order.
        model: served model name put in each body.
        system_prompt: a system message put first in every turn's messages (None: none).
        request_timeout_s: limit per turn, seconds.
        overall_timeout_s: limit on the whole replay, seconds; turns still open then are reported as cancelled,
            turns not sent by then as not sent.
        progress: show a tqdm bar of finished turns (on stderr, when it is a terminal).
        progress_desc: label of the bar.

    Returns:
        One result per turn, session order then turn order (ids ``"<session id>/<k>"``); a turn after a failed
        one is not sent (its session ends there) and reported with an error.
    """
    urls = [u.rstrip("/") + CHAT_PATH for u in ([base_url] if isinstance(base_url, str) else base_url)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=progress_desc, unit="req",
               disable=None if progress else True, leave=True)
    start_s = time.monotonic()
    deadline_s = start_s + overall_timeout_s
    try:
        async with aiohttp.ClientSession(connector=connector) as http:
            tasks = [asyncio.create_task(_replay_session(http, urls[s.router % len(urls)], model, s, start_s,
                                                         deadline_s, request_timeout_s, system_prompt,
                                                         lambda: bar.update(1)))
                     for s in sessions]
            await _finish_by(tasks, deadline_s)
    finally:
        bar.close()
    out: list[RequestResult] = []
    for task, chat in zip(tasks, sessions):
        if not task.cancelled() and task.exception() is None:
            out.extend(task.result())
            continue
        if not task.cancelled():
            logger.error("session %s raised %r", chat.id, task.exception())
        why = (f"cancelled at the overall timeout of {overall_timeout_s:g} s" if task.cancelled()
               else f"{type(task.exception()).__name__}: {task.exception()}"[:_MAX_ERROR_CHARS])
        out.extend(RequestResult(f"{chat.id}/{k}", t.num_prompt_tokens, t.num_output_tokens, chat.start_offset_s,
                                 error=why) for k, t in enumerate(chat.turns))
    return out


def _pad(
    tasks: list[asyncio.Task[RequestResult]], trace: Sequence[TraceRequest]
) -> list[tuple[asyncio.Task[RequestResult] | None, TraceRequest]]:
    return [(tasks[i] if i < len(tasks) else None, request) for i, request in enumerate(trace)]


def _result_of(
    task: asyncio.Task[RequestResult] | None, request: TraceRequest, start_s: float, overall_timeout_s: float
) -> RequestResult:
    if task is None:
        return RequestResult(
            request.id, request.num_prompt_tokens, request.num_output_tokens, request.arrival_offset_s,
            error=f"not sent: overall timeout of {overall_timeout_s:g} s",
        )
    if task.cancelled():
        return RequestResult(
            request.id, request.num_prompt_tokens, request.num_output_tokens, request.arrival_offset_s,
            error=f"cancelled at the overall timeout of {overall_timeout_s:g} s",
        )
    exc = task.exception()
    if exc is not None:
        # send_request catches request failures; anything else is a bug worth seeing in the table and log.
        logger.error("request %s raised %r", request.id, exc)
        return RequestResult(
            request.id, request.num_prompt_tokens, request.num_output_tokens, request.arrival_offset_s,
            error=f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS],
        )
    return task.result()


def run_replay(base_url: str, trace: Sequence[TraceRequest], **kwargs: object) -> list[RequestResult]:
    """Synchronous wrapper of :func:`replay` (runs its own event loop); same arguments and result."""
    return asyncio.run(replay(base_url, trace, **kwargs))  # type: ignore[arg-type]
