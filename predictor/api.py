"""The predictor gRPC API: ``predictor.proto`` compiled with grpcio-tools.

The generated modules (``predictor/predictor_pb2.py``, ``predictor/predictor_pb2_grpc.py``) are not committed:
``make install`` generates them, and importing this module regenerates them when they are missing or older than
``predictor.proto`` (so an edited .proto can never run with stale stubs). Import the messages from here::

    from predictor.api import pb, pb_grpc
"""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_PATH = _PACKAGE_DIR / "predictor.proto"
NOTIFY_READY_KEY = "astrolabe-notify"
"""Initial metadata key of a Notify stream (protocol v1.3, ``predictor.proto``): the sidecar sends it (with its
protocol revision) when it starts reading the stream; the router queues notices on the stream only after it."""
_GENERATED = (_PACKAGE_DIR / "predictor_pb2.py", _PACKAGE_DIR / "predictor_pb2_grpc.py")


def generate(force: bool = False) -> bool:
    """Compiles ``predictor.proto`` next to it if needed; returns True when it ran protoc.

    Raises:
        RuntimeError: protoc failed (the message carries its exit status).
    """
    proto_mtime = PROTO_PATH.stat().st_mtime
    if not force and all(p.exists() and p.stat().st_mtime >= proto_mtime for p in _GENERATED):
        return False
    from grpc_tools import protoc  # noqa: PLC0415 (only needed when generating)

    root = _PACKAGE_DIR.parent
    # Into a private folder, then renamed into place: several processes starting at once (a fleet of sidecars on
    # a fresh checkout) must never import a half-written module.
    with tempfile.TemporaryDirectory(dir=_PACKAGE_DIR, prefix=".protoc-") as out:
        status = protoc.main(["grpc_tools.protoc", f"-I{root}", f"--python_out={out}", f"--grpc_python_out={out}",
                              str(PROTO_PATH.relative_to(root))])
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO_PATH} (exit status {status})")
        for path in _GENERATED:
            os.replace(Path(out) / path.relative_to(root), path)
    importlib.invalidate_caches()
    return True


generate()

from predictor import predictor_pb2 as pb  # noqa: E402
from predictor import predictor_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc", "generate", "PROTO_PATH", "NOTIFY_READY_KEY"]

if __name__ == "__main__":
    print("generated" if generate(force=True) else "up to date")
