"""A backend that answers at once: ``python -m bench.fast_backend --port P``, for measuring what the router adds.

Every ``POST`` is read to its end and, by default, answered at once with a fixed one-token OpenAI chat completion
(the body is not parsed: the backend's cost is the same for every request and every prompt size, so the difference
between two routes to it is the routes' own cost). Two opt-ins, for the scale bench (`bench.streams`):

- **Streaming.** A body with ``"stream": true`` (the only body that is parsed: a byte search for the ``"stream"``
  key decides, so other bodies cost nothing more) gets OpenAI-style server-sent events: ``max_tokens`` (or
  ``max_completion_tokens``; else ``--tokens``) chunks ``data: {...}\\n\\n``, chunk *k* sent *k* ×
  ``--token-interval-s`` seconds after the response started (the header ``x-token-interval-s`` overrides it per
  request), the last with a ``finish_reason``, then ``data: [DONE]``. ``/v1/completions`` gets
  ``text_completion`` chunks, every other path ``chat.completion.chunk`` ones.
- **A delay.** The header ``x-response-delay-s: S`` holds the response for ``S`` seconds before it starts, sending
  nothing meanwhile (what a long non-streamed completion does: vLLM sends its headers and body when it is done).

``GET /health`` answers 200; ``GET /metrics`` gives the vLLM gauges a predictor sidecar reconciles with
(``vllm:num_requests_running`` = requests in progress here, a stream counting until its last byte is written or
its client went away; nothing waiting, an empty KV cache, ``vllm:cache_config_info`` with ``--num-gpu-blocks``),
so a sidecar in ledger mode serves predictions for it. Replies name the instance in ``x-emulator-instance``, as
the emulator does. Imports aiohttp and the standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

INSTANCE_HEADER = "x-emulator-instance"
"""Response header naming the instance (``host:port``), as ``bench.emulator`` sets it."""
TOKEN_INTERVAL_HEADER = "x-token-interval-s"
"""Request header: seconds between a streamed response's chunks, for this request (over ``--token-interval-s``)."""
DELAY_HEADER = "x-response-delay-s"
"""Request header: seconds the response is held, silent, before it starts."""
DEFAULT_TOKEN_INTERVAL_S = 1.0
"""Seconds between streamed chunks unless ``--token-interval-s`` or `TOKEN_INTERVAL_HEADER` says otherwise."""
DEFAULT_TOKENS = 16
"""Chunks of a streamed response whose body names no ``max_tokens``."""
DONE_EVENT = b"data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""

_COMPLETION = json.dumps({
    "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": "fast-backend",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}).encode()
_STREAM_KEY = b'"stream"'


def metrics_text(num_running: int, num_gpu_blocks: int, block_size: int) -> str:
    """vLLM V1's gauges for an instance with ``num_running`` requests and an empty KV cache (Prometheus text)."""
    labels = 'engine="0",model_name="fast-backend"'
    return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {num_running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} 0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{block_size}\","
            f"engine=\"0\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0\n")


def sse_chunk(chat: bool, finish_reason: str | None = None) -> bytes:
    """One server-sent event carrying one token (``"ok "``) of a chat (``chat``) or text completion stream."""
    if chat:
        choice = {"index": 0, "delta": {"content": "ok "}, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": "ok ", "finish_reason": finish_reason}
        kind = "text_completion"
    event = {"id": "cmpl-fast", "object": kind, "created": 0, "model": "fast-backend", "choices": [choice]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def stream_tokens(body: bytes, default_tokens: int) -> int | None:
    """Chunks a streamed reply to ``body`` gets: its ``max_tokens`` (or ``max_completion_tokens``), else
    ``default_tokens``; None when ``body`` is not a JSON object with ``"stream": true`` (answer it at once)."""
    if _STREAM_KEY not in body:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("stream") is not True:
        return None
    tokens = request.get("max_tokens", request.get("max_completion_tokens"))
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1 else default_tokens


def _header_seconds(request: web.Request, name: str, default_s: float) -> float:
    """A non-negative number of seconds from header ``name``, else ``default_s``.

    Raises:
        aiohttp.web.HTTPBadRequest: the header is not a finite number >= 0.
    """
    text = request.headers.get(name)
    if text is None:
        return default_s
    try:
        value_s = float(text)
    except ValueError:
        value_s = -1.0
    if not 0.0 <= value_s < float("inf"):
        raise web.HTTPBadRequest(text=f"{name} must be seconds >= 0, got {text!r}")
    return value_s


def make_app(address: str, num_gpu_blocks: int = 16384, block_size: int = 16, *,
             token_interval_s: float = DEFAULT_TOKEN_INTERVAL_S, default_tokens: int = DEFAULT_TOKENS
             ) -> web.Application:
    """The backend's routes (module docstring); ``address`` is what ``x-emulator-instance`` says;
    ``token_interval_s`` seconds between streamed chunks, ``default_tokens`` chunks when the body names none."""
    num_running = 0
    chunks = {chat: (sse_chunk(chat), sse_chunk(chat, "length")) for chat in (True, False)}

    async def stream(request: web.Request, num_tokens: int) -> web.StreamResponse:
        interval_s = _header_seconds(request, TOKEN_INTERVAL_HEADER, token_interval_s)
        token, last = chunks[not request.path.endswith("/v1/completions")]
        response = web.StreamResponse(headers={INSTANCE_HEADER: address, "content-type": "text/event-stream",
                                               "cache-control": "no-cache"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        try:
            for k in range(num_tokens):
                # An absolute schedule: a late wake-up does not push every later chunk back.
                await asyncio.sleep(max(0.0, start_s + k * interval_s - loop.time()))
                await response.write(last if k == num_tokens - 1 else token)
            await response.write(DONE_EVENT)
            await response.write_eof()
        except (ConnectionResetError, ConnectionAbortedError):
            pass  # the client (Envoy) went away: nothing more to send
        return response

    async def complete(request: web.Request) -> web.StreamResponse:
        nonlocal num_running
        num_running += 1
        try:
            body = await request.read()
            delay_s = _header_seconds(request, DELAY_HEADER, 0.0)
            num_tokens = stream_tokens(body, default_tokens)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if num_tokens is not None:
                return await stream(request, num_tokens)
            return web.Response(body=_COMPLETION, content_type="application/json",
                                headers={INSTANCE_HEADER: address})
        finally:
            num_running -= 1

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=metrics_text(num_running, num_gpu_blocks, block_size))

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/{tail:.*}", complete)
    return app


def main(argv: list[str] | None = None) -> None:
    """Serves until killed."""
    parser = argparse.ArgumentParser(prog="python -m bench.fast_backend", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--num-gpu-blocks", type=int, default=16384, help="KV blocks reported (default 16384)")
    parser.add_argument("--token-interval-s", type=float, default=DEFAULT_TOKEN_INTERVAL_S,
                        help=f"seconds between streamed chunks (default {DEFAULT_TOKEN_INTERVAL_S:g}; the request "
                             f"header {TOKEN_INTERVAL_HEADER} overrides it)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help=f"chunks of a stream whose body has no max_tokens (default {DEFAULT_TOKENS})")
    args = parser.parse_args(argv)
    if not (args.token_interval_s >= 0 and args.tokens >= 1):
        parser.error("--token-interval-s must be >= 0 and --tokens >= 1")
    web.run_app(make_app(f"{args.host}:{args.port}", args.num_gpu_blocks, token_interval_s=args.token_interval_s,
                         default_tokens=args.tokens),
                host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
