"""The real-SGLang tier: collected only when ASTROLABE_SGLANG_TESTS=1 (``make test-sglang``), since it needs
``.venv-sglang`` (``make install-sglang``), ~5 GB of RAM and a few minutes; ``make test`` leaves it out.

One session-wide stack: 2 real SGLang servers (SGLang 0.5.23 on CPU, tiny model; deploy/sglang/launch.py), a sidecar
beside each (``--backend-engine auto``, its ledger reconciled from SGLang's gauges; SGLang has no state plugin), the
extproc with the astrolabe policy (Po2 on predictions) behind real Envoy, and a second extproc with the ``gie``
policy (``metrics_format: sglang``) behind a second Envoy. Every process is stopped by PID at the end; the logs stay
in ``.cache/sglang/test-run/``.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from astrolabe.procs import ProcessGroup
from deploy.sglang.launch import REPO_DIR, start_sglang_servers
from tests.integration.stack import Stack, signal_process

if os.environ.get("ASTROLABE_SGLANG_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]

BATCH_TIME_MODEL = REPO_DIR / "deploy" / "vllm" / "tiny-llama-cpu.json"
"""The tiny model's step times fitted on this CPU under vLLM: not SGLang's, but one shared model keeps the two
sidecars' predictions comparable (the vLLM tier's reason for calibration off on a shared 2-core box)."""

HEALTH_CHECK = {"interval_s": 1.0, "timeout_s": 3.0, "unhealthy_threshold": 3}
"""SGLang's /health generates a token and answers after ~1 s: the default 1 s timeout fails it (README)."""


@pytest.fixture(scope="session")
def sglang_stack():
    # Not pytest's tmp_path: other pytest sessions on a shared machine rotate /tmp/pytest-of-<user> away.
    tmp = REPO_DIR / ".cache" / "sglang" / "test-run"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ProcessGroup() as procs:
        servers = start_sglang_servers(procs, 2, tmp)
        stack = Stack(procs, tmp, "full-duplex")
        stack.sglang = servers
        # The sidecars get the flags' defaults (vLLM's): the KV cache and limits they use must come from SGLang.
        stack.sidecars = {
            s.address: stack.start_sidecar(s.address, "--backend-engine", "auto", "--batch-time-model",
                                           str(BATCH_TIME_MODEL), "--calibration", "off")
            for s in servers}
        stack.write_config([{"address": a, "predictor": p} for a, p in stack.sidecars.items()],
                           policy="astrolabe", policy_params={"k": 2}, seed=0, output_length={"source": "oracle"},
                           predictor_client={"predict_timeout_s": 2.0, "notify_timeout_s": 2.0,
                                             # Predict round trips: in watch mode (the default) 4 of 24 decisions
                                             # here had no prediction, cause not found yet (issue 23's note)
                                             "mode": "predict"},
                           health_check=HEALTH_CHECK, decision_log_path=str(tmp / "decisions.jsonl"))
        stack.start_extproc()
        stack.start_envoy()
        gie = Stack(procs, tmp / "gie", "buffered")
        gie.tmp.mkdir()
        gie.write_config([{"address": s.address} for s in servers], policy="gie", metrics_format="sglang",
                         health_check=HEALTH_CHECK, decision_log_path=str(gie.tmp / "decisions.jsonl"))
        gie.start_extproc()
        gie.start_envoy()
        stack.gie = gie
        yield stack
        # SGLang drains on SIGTERM but looks at it only every 5 s (TokenizerManager.sigterm_watchdog): signal both
        # servers at once, so their drains overlap before the group stops each in turn.
        for server in servers:
            signal_process(server.process, signal.SIGTERM)
