"""The extproc exits 2 with the key named when a file or port its configuration names cannot be used."""

import json
import socket
import subprocess
import sys


def run_extproc(tmp_path, **extra):
    config = {"listen": "127.0.0.1:0", "policy": "least-requests", "health_check": {"enabled": False},
              "endpoints": [{"address": "127.0.0.1:9"}], **extra}
    path = tmp_path / "extproc.yaml"
    path.write_text(json.dumps(config))
    return subprocess.run([sys.executable, "-m", "astrolabe", "extproc", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_unusable_decision_log_is_a_configuration_error(tmp_path):
    done = run_extproc(tmp_path, decision_log_path=str(tmp_path))  # a directory
    assert done.returncode == 2 and "invalid configuration: decision_log_path: cannot open" in done.stderr
    assert "Traceback" not in done.stderr


def test_metrics_port_in_use_is_a_configuration_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = run_extproc(tmp_path, metrics_listen=f"127.0.0.1:{busy.getsockname()[1]}")
    assert done.returncode == 2 and "invalid configuration: metrics_listen: cannot listen on" in done.stderr
    assert "Traceback" not in done.stderr


def test_with_workers_the_same_errors_exit_2(tmp_path):
    """workers > 1: the supervisor's own checks (metrics port) and a worker's (decision log) give the messages one
    process gives, and nothing is left running (the run returns)."""
    done = run_extproc(tmp_path, workers=2, decision_log_path=str(tmp_path))  # found by the workers
    assert done.returncode == 2 and "invalid configuration: decision_log_path: cannot open" in done.stderr
    assert "Traceback" not in done.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = run_extproc(tmp_path, workers=2, metrics_listen=f"127.0.0.1:{busy.getsockname()[1]}")
    assert done.returncode == 2 and "invalid configuration: metrics_listen: cannot listen on" in done.stderr
    done = run_extproc(tmp_path, workers=0)
    assert done.returncode == 2 and "invalid configuration: workers:" in done.stderr
