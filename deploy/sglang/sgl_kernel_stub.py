"""A stand-in for the ``sgl_kernel`` package, installed as ``sgl_kernel/__init__.py`` into ``.venv-sglang`` by
``deploy/sglang/fixes.py`` (``make install-sglang``).

Why: SGLang imports ``sgl_kernel`` (its compiled CUDA/CPU kernels) at module level in many places, and PyPI ships
only CUDA builds of sgl-kernel; a CPU build needs SGLang's source tree, which cannot be fetched here
(bench/README-sglang.md). On the torch-native path the tier runs (``--attention-backend torch_native
--sampling-backend pytorch --disable-cuda-graph``, no AMX kernels: SGLang checks for them through
``torch.ops.sgl_kernel``, which this stub does not register) none of its kernels is called, only imported.

Every attribute of the package, and of any ``sgl_kernel.<sub>`` module, is a placeholder: importing or naming it
works, calling it raises ``NotImplementedError`` naming it (so a code path that does need a kernel fails loudly, not
silently); used as a base class it is ``object``. Standard library only.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+astrolabe.stub"


class _Stub:
    """A placeholder for ``sgl_kernel.<name>``: its attributes are placeholders too; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stub called: {self._name} (no CPU build of sgl-kernel installed)")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._name}>"

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{module_name}.{attr}")

    return __getattr__


__getattr__ = _module_getattr("sgl_kernel")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``import sgl_kernel.<sub>`` with an empty package whose attributes are placeholders."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
