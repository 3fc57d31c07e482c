"""Build hook: compiles predictor/sim/fast_predict.py and the KV block pools it drives (predictor/sim/kv_blocks.py,
predictor/sim/prefix_cache.py: the prefix-cache bookkeeping of predictions with block keys) with mypyc into C
extensions beside the .py files (their shared library: predictor/sim/compiled__mypyc*.so).

fast_predict.py stays the reference, and is what runs where its extension is missing or older than it
(predictor/sim/predict.py); a pool extension older than its .py is reported by the same check (Python imports the
extension all the same: `make install` rebuilds it). Optional: where they cannot be compiled (no C compiler) the
build warns and goes on, and everything runs from the .py files.
Everything else is declared in pyproject.toml.
"""

from mypyc.build import mypycify
from setuptools import setup

# --follow-imports=silent / --ignore-missing-imports: pip's isolated build environment has no numpy, which
# predictor.sim.batch_time imports; the compiled module needs nothing of it at build time.
# kv_blocks.py is compiled because prefix_cache.py's pool extends its BlockPool (a compiled class's bases must be
# compiled too).
COMPILED_SOURCES = ["predictor/sim/fast_predict.py", "predictor/sim/kv_blocks.py", "predictor/sim/prefix_cache.py"]
extensions = mypycify(["--follow-imports=silent", "--ignore-missing-imports", *COMPILED_SOURCES],
                      group_name="predictor.sim.compiled")
for extension in extensions:
    extension.optional = True
setup(ext_modules=extensions)
