"""The real-vLLM tier: collected only when ASTROLABE_VLLM_TESTS=1 (``make test-vllm``), since it needs
``.venv-vllm`` (``make install-vllm``), ~6 GB of RAM and a few minutes; ``make test`` leaves it out.

One session-wide stack: 2 vLLM servers (tiny model, plugin on), a sidecar beside each reading the plugin's state,
the extproc with the astrolabe policy (Po2), and the real Envoy. Every process is stopped by PID at the end; the
logs stay in ``.cache/vllm/test-run/``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from astrolabe.procs import ProcessGroup
from deploy.vllm.launch import REPO_DIR, SERVED_MODEL_NAME, remove_stale_state_files, start_vllm_servers, state_dir
from tests.integration.stack import Stack

if os.environ.get("ASTROLABE_VLLM_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]

BATCH_TIME_MODEL = REPO_DIR / "deploy" / "vllm" / "tiny-llama-cpu.json"
"""Coefficients of the tiny model on this machine's CPU (``astrolabe predictor profile``; deploy/vllm/README)."""
ROUTER_SETTINGS = {
    # Generous deadlines: vLLM servers keep this 2-core box's CPUs busy.
    "predictor_client": {"predict_timeout_s": 2.0, "notify_timeout_s": 2.0},
    # vLLM's /health answers late while its engine saturates both cores: the default thresholds, not the
    # integration tests' hair-trigger ones.
    "health_check": {"interval_s": 1.0, "timeout_s": 3.0, "unhealthy_threshold": 3},
}
"""Extproc config keys of every real-vLLM stack."""


def fresh_run_dir(name: str):
    """``.cache/vllm/<name>``, emptied: the logs of one stack, kept after the run. Not pytest's tmp_path: other
    pytest sessions on a shared machine rotate /tmp/pytest-of-<user> away."""
    tmp = REPO_DIR / ".cache" / "vllm" / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def pytest_sessionfinish(session, exitstatus):
    """The servers' plugin state files outlive them by design (the sidecar must see the engine gone;
    deploy/vllm/launch.py): once every stack has stopped, the tier removes those whose engine is gone, so a run
    leaves none in /dev/shm (files of a live engine, e.g. another run's, stay)."""
    remove_stale_state_files(state_dir(REPO_DIR / ".cache" / "vllm"))


@pytest.fixture(scope="session")
def vllm_stack():
    tmp = fresh_run_dir("test-run")
    with ProcessGroup() as procs:
        servers = start_vllm_servers(procs, 2, tmp)
        stack = Stack(procs, tmp, "full-duplex")
        stack.vllm = servers
        # Calibration off for the routing stack: on this 2-core box both servers share the CPU, so a step's time
        # depends on what the other server does, and two sidecars calibrating online from different moments
        # disagree by up to 2x (Po2 then sent 40 of 48 requests to one server: bench/README-vllm.md). Online
        # calibration on real vLLM has its own test with its own sidecar.
        stack.sidecars = {
            s.address: stack.start_sidecar(s.address, "--state-source", "vllm-plugin", "--vllm-state-path",
                                           str(s.state_path), "--batch-time-model", str(BATCH_TIME_MODEL),
                                           "--calibration", "off")
            for s in servers}
        stack.write_config([{"address": a, "models": [SERVED_MODEL_NAME], "predictor": p}
                            for a, p in stack.sidecars.items()],
                           policy="astrolabe", policy_params={"k": 2}, seed=0,
                           output_length={"source": "oracle"}, **ROUTER_SETTINGS)
        stack.start_extproc()
        stack.start_envoy()
        yield stack
