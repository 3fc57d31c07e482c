"""Starts N real SGLang servers (SGLang 0.5.23 on CPU, from ``.venv-sglang``) on loopback, serving the tiny model.

Used by the SGLang test tier (``tests/sglang/``); also runnable by hand::

    .venv/bin/python -m deploy.sglang.launch -n 2 --base-port 30000     # Ctrl-C stops them

Each server: ``python -m sglang.launch_server`` on the CPU with the torch-native attention and sampling backends
(no sgl-kernel: ``.venv-sglang`` has a stub, bench/README-sglang.md), no CUDA graphs, no overlap scheduling,
``--enable-metrics``, a KV pool of ``max_total_tokens`` tokens in pages of ``page_size``, the radix (prefix) cache
off (the predictor models vLLM's prefix cache, not SGLang's radix cache), and
``--decode-log-interval 1``: SGLang refreshes its load gauges (``sglang:num_running_reqs``, ``num_queue_reqs``,
``token_usage``) only on every N-th decode step (default 40), and a reader that reconciles from them needs each
step's. ``OMP_NUM_THREADS=1``: one compute thread per server (SGLang's own core binding needs the AMX kernels of a
real sgl-kernel and is off here). Startup to ``/health`` takes ~20-35 s here, ~2.2 GB RSS each (tokenizer manager,
scheduler and detokenizer processes). Imports only the standard library and ``astrolabe.procs``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astrolabe.procs import ManagedProcess, ProcessGroup, free_port, interrupt_on_termination, wait_while_running

logger = logging.getLogger(__name__)

REPO_DIR = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO_DIR / ".venv-sglang" / "bin" / "python"
"""The SGLang venv's interpreter (``make install-sglang``)."""
DEFAULT_MODEL_DIR = REPO_DIR / ".cache" / "sglang" / "tiny-llama"
"""Where ``make install-sglang`` builds the tiny model (``deploy/vllm/make_tiny_model.py``)."""
SERVED_MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 300.0
"""Bound on waiting for /health (~20-35 s here; more on a loaded machine)."""


@dataclass(frozen=True, slots=True)
class SglangSettings:
    """Engine settings of every launched server (SGLang flag names; units in the names).

    Attributes:
        context_length: tokens of prompt + output per request.
        max_running_requests: most running requests.
        chunked_prefill_size: prefill token budget per step.
        max_total_tokens: KV pool size, tokens.
        page_size: tokens per KV page.
        decode_log_interval: decode steps between two refreshes of the load gauges.
    """

    context_length: int = 256
    max_running_requests: int = 8
    chunked_prefill_size: int = 256
    max_total_tokens: int = 1024
    page_size: int = 32
    decode_log_interval: int = 1


@dataclass(frozen=True, slots=True)
class SglangServer:
    """One launched server: its process and ``host:port`` address."""

    process: ManagedProcess
    address: str


def sglang_command(model_dir: Path, port: int, settings: SglangSettings) -> list[str]:
    """The command line of one server on ``127.0.0.1:port``."""
    return [str(SGLANG_PYTHON), "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-overlap-schedule", "--disable-cuda-graph", "--disable-radix-cache", "--enable-metrics",
            "--mem-fraction-static", "0.5", "--context-length", str(settings.context_length),
            "--max-running-requests", str(settings.max_running_requests),
            "--chunked-prefill-size", str(settings.chunked_prefill_size),
            "--max-total-tokens", str(settings.max_total_tokens), "--page-size", str(settings.page_size),
            "--decode-log-interval", str(settings.decode_log_interval)]


def sglang_env(index: int) -> dict[str, str]:
    """Environment of server ``index``: SGLang's CPU engine, offline hub, one compute thread."""
    return {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "SGLANG_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)), "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


def start_sglang_servers(procs: ProcessGroup, num_servers: int, work_dir: Path, *,
                         settings: SglangSettings = SglangSettings(), model_dir: Path = DEFAULT_MODEL_DIR,
                         ports: list[int] | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> list[SglangServer]:
    """Start ``num_servers`` servers at once, then wait until each answers /health.

    Args:
        procs: owns the processes (stops each server's process group on exit).
        num_servers: how many (2 fit this machine: ~2.2 GB each).
        work_dir: folder for the logs (created).
        settings: engine settings.
        model_dir: the model (``make install-sglang`` builds it).
        ports: ports to use; None = free ports.
        timeout_s: bound on each server's startup, seconds.

    Raises:
        astrolabe.procs.ProcessStartError: a server exited or did not become healthy in time.
        FileNotFoundError: no ``.venv-sglang`` or no model (run ``make install-sglang``).
    """
    for needed in (SGLANG_PYTHON, model_dir / "config.json"):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed} not found: run `make install-sglang` first")
    work_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for index in range(num_servers):
        port = ports[index] if ports else free_port()
        process = procs.start(sglang_command(model_dir, port, settings), name=f"sglang-{port}",
                              env=sglang_env(index), log_path=work_dir / f"sglang-{port}.log", cwd=REPO_DIR,
                              private_tmp=True)  # SGLang leaves ZMQ sockets and metrics folders in the temp folder
        servers.append(SglangServer(process, f"127.0.0.1:{port}"))
    started_s = time.monotonic()
    for server in servers:
        # /health generates one token and answers after ~1 s; wait_http's GETs allow for that.
        server.process.wait_http(f"http://{server.address}/health", timeout_s=timeout_s)
        logger.info("SGLang at %s healthy after %.0f s", server.address, time.monotonic() - started_s)
    return servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="start N SGLang servers (tiny model, CPU) on loopback until Ctrl-C")
    parser.add_argument("-n", "--num-servers", type=int, default=2)
    parser.add_argument("--base-port", type=int, default=30000, help="server i listens on base-port + i")
    parser.add_argument("--work-dir", type=Path, default=REPO_DIR / ".cache" / "sglang" / "run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interrupt_on_termination()  # SIGTERM / SIGINT end the wait below, so the servers are stopped
    with ProcessGroup() as procs:
        servers = start_sglang_servers(procs, args.num_servers, args.work_dir,
                                       ports=[args.base_port + i for i in range(args.num_servers)])
        for server in servers:
            logger.info("serving %s at http://%s", SERVED_MODEL_NAME, server.address)
        wait_while_running([s.process for s in servers])
    return 0


if __name__ == "__main__":
    sys.exit(main())
