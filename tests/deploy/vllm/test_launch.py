"""The vLLM launcher's command line and state-file housekeeping (starting real servers is tests/vllm's job)."""

import json
import os
import subprocess
import sys

from deploy.vllm.launch import VllmSettings, remove_stale_state_files, vllm_command, vllm_env


def test_command_carries_the_small_kv_cache_and_the_engine_limits(tmp_path):
    cmd = vllm_command(tmp_path, 8123, VllmSettings())
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--kv-cache-memory-bytes"] == str(1 << 20) and flags["--max-model-len"] == "256"
    assert "--enforce-eager" in cmd and "--enable-prompt-tokens-details" in cmd  # cached tokens in each usage
    assert not [a for a in cmd if "prefix-caching" in a]  # vLLM V1's default: prefix caching on


def test_env_is_offline_binds_one_core_and_names_the_state_file(tmp_path):
    env = vllm_env(1, tmp_path / "s.json")
    assert env["HF_HUB_OFFLINE"] == "1" and env["ASTROLABE_VLLM_STATE_PATH"] == str(tmp_path / "s.json")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(1 % os.cpu_count())
    assert vllm_env(0, None)["ASTROLABE_VLLM_STATE_PATH"] == ""  # plugin disabled


def test_only_state_files_of_dead_engines_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (tmp_path / "astrolabe-vllm-1.state.json").write_text(json.dumps({"pid": os.getpid()}))
    (tmp_path / "astrolabe-vllm-2.state.json").write_text(json.dumps({"pid": int(dead.stdout)}))
    (tmp_path / "astrolabe-vllm-3.state.json").write_text("{half")
    (tmp_path / "other.json").write_text("{}")
    assert remove_stale_state_files(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["astrolabe-vllm-1.state.json", "other.json"]
