"""A backend that answers at once: ``python -m bench.fast_backend --port P``, for measuring what the router adds.

Every ``POST`` is read to its end and answered at once with a fixed one-token OpenAI chat completion (the body
is not parsed: the backend's cost is the same for every request and every prompt size, so the difference between
two routes to it is the routes' own cost). ``GET /health`` answers 200; ``GET /metrics`` gives the vLLM gauges a
predictor sidecar reconciles with (``vllm:num_requests_running`` = requests in progress here, nothing waiting,
an empty KV cache, ``vllm:cache_config_info`` with ``--num-gpu-blocks``), so a sidecar in ledger mode serves
predictions for it. Replies name the instance in ``x-emulator-instance``, as the emulator does. Imports aiohttp
and the standard library only.
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

INSTANCE_HEADER = "x-emulator-instance"
"""Response header naming the instance (``host:port``), as ``bench.emulator`` sets it."""

_COMPLETION = json.dumps({
    "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": "fast-backend",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}).encode()


def metrics_text(num_running: int, num_gpu_blocks: int, block_size: int) -> str:
    """vLLM V1's gauges for an instance with ``num_running`` requests and an empty KV cache (Prometheus text)."""
    labels = 'engine="0",model_name="fast-backend"'
    return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {num_running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} 0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
            f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{block_size}\","
            f"engine=\"0\",num_gpu_blocks=\"{num_gpu_blocks}\"}} 1.0\n")


def make_app(address: str, num_gpu_blocks: int = 16384, block_size: int = 16) -> web.Application:
    """The backend's routes (module docstring); ``address`` is what ``x-emulator-instance`` says."""
    num_running = 0

    async def complete(request: web.Request) -> web.Response:
        nonlocal num_running
        num_running += 1
        try:
            await request.read()
        finally:
            num_running -= 1
        return web.Response(body=_COMPLETION, content_type="application/json", headers={INSTANCE_HEADER: address})

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
    args = parser.parse_args(argv)
    web.run_app(make_app(f"{args.host}:{args.port}", args.num_gpu_blocks), host=args.host, port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
