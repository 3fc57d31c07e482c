"""The two fixes SGLang 0.5.23 from PyPI needs to run on a CPU, applied to the venv of the Python that runs this.

Run by ``make install-sglang`` with ``.venv-sglang``'s Python, after ``pip install --no-deps -r
deploy/sglang/requirements.txt``::

    .venv-sglang/bin/python -m deploy.sglang.fixes

1. **sgl_kernel**: copies ``deploy/sglang/sgl_kernel_stub.py`` to ``<site-packages>/sgl_kernel/__init__.py`` (a
   plain package folder: no ``.pth`` file, no dist-info, so ``pip`` does not list it; ``pip uninstall`` does not
   remove it, deleting the venv does). PyPI's wheels of it (``sglang-kernel``, which sglang requires, and
   ``sgl-kernel``) are CUDA builds; the stub's docstring says why nothing of it is called on the tier's
   torch-native path. Refuses to overwrite a real one.
2. **torchvision 0.28.0**: its compiled ops (``torchvision/_C.so``) are built against PyPI's CUDA torch and do not
   load beside torch 2.13.0+cpu, so the fake-tensor and autograd registrations of those ops
   (``torchvision/_meta_registrations.py``, ``_autograd_registrations.py``), which run at ``import torchvision``
   and look the ops up, raise; they are replaced by a comment line. ``import torchvision`` then works (SGLang and
   transformers import it for image processing; the tiny text model never calls its ops). Refuses any other
   torchvision version. Idempotent. Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import sys
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

STUB_SOURCE = Path(__file__).resolve().with_name("sgl_kernel_stub.py")
KERNEL_DISTRIBUTIONS = ("sglang-kernel", "sgl-kernel")
"""Distributions that ship the real ``sgl_kernel`` module (sglang 0.5.23 asks for ``sglang-kernel==0.4.10``)."""
TORCHVISION_VERSION = "0.28.0"
"""The torchvision the fix was made for (deploy/sglang/requirements.txt)."""
TORCHVISION_REGISTRATIONS = ("_meta_registrations.py", "_autograd_registrations.py")
STUBBED_LINE = "# stubbed by deploy/sglang/fixes.py: torchvision's _C ops do not load beside torch+cpu\n"


def install_sgl_kernel_stub(site_packages: Path) -> Path:
    """Writes the stub as ``site_packages/sgl_kernel/__init__.py``; returns that path.

    Raises:
        RuntimeError: a real sgl_kernel (`KERNEL_DISTRIBUTIONS`) is installed.
    """
    for distribution in KERNEL_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        raise RuntimeError(f"{distribution} {version} is installed: not replacing its sgl_kernel with the stub")
    package = site_packages / "sgl_kernel"
    if package.exists() and any(p.name not in ("__init__.py", "__pycache__") for p in package.iterdir()):
        raise RuntimeError(f"{package} holds more than a stub: not replacing it")
    package.mkdir(exist_ok=True)
    target = package / "__init__.py"
    shutil.copyfile(STUB_SOURCE, target)
    shutil.rmtree(package / "__pycache__", ignore_errors=True)
    return target


def fix_torchvision(site_packages: Path) -> list[Path]:
    """Blanks torchvision's op registrations (module docstring); returns the files written.

    Raises:
        RuntimeError: torchvision is missing or not `TORCHVISION_VERSION`, or a registration file is missing.
    """
    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("torchvision is not installed") from None
    if version != TORCHVISION_VERSION:
        raise RuntimeError(f"torchvision {version} installed; the fix is for {TORCHVISION_VERSION}")
    written = []
    for name in TORCHVISION_REGISTRATIONS:
        path = site_packages / "torchvision" / name
        if not path.is_file():
            raise RuntimeError(f"{path} not found")
        path.write_text(STUBBED_LINE, encoding="utf-8")
        written.append(path)
    return written


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    try:
        logger.info("sgl_kernel stub: %s", install_sgl_kernel_stub(site_packages))
        logger.info("torchvision registrations blanked: %s", ", ".join(map(str, fix_torchvision(site_packages))))
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
