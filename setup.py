"""Build hook: compiles predictor/sim/fast_predict.py with mypyc into a C extension beside the .py.

The .py stays the reference, and is what runs where the extension is missing or older than it
(predictor/sim/predict.py). Optional: where it cannot be compiled (no C compiler) the build warns and goes on.
Everything else is declared in pyproject.toml.
"""

from mypyc.build import mypycify
from setuptools import setup

# --follow-imports=silent / --ignore-missing-imports: pip's isolated build environment has no numpy, which
# predictor.sim.batch_time imports; the compiled module needs nothing of it at build time.
extensions = mypycify(["--follow-imports=silent", "--ignore-missing-imports", "predictor/sim/fast_predict.py"])
for extension in extensions:
    extension.optional = True
setup(ext_modules=extensions)
