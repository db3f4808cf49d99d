# slurm-recovery: the two commands a newcomer needs are `make demo` and `make test`.
# Both install what they need first (Debian packages + a virtualenv in .venv).

PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(CURDIR)/$(VENV)/bin
UID         := $(shell id -u)
SUDO        := $(if $(filter 0,$(UID)),,sudo)
# the dev cluster the demo leaves running, and the one the test suite uses
DEMO_STATE_DIR ?= /tmp/recovery-devcluster-$(UID)
TEST_STATE_DIR ?= /tmp/recovery-test-cluster-$(UID)
TEST_PORT      ?= 26817
PYTEST_ARGS    ?=

APT_PACKAGES := slurm-wlm slurmctld slurmd slurm-client munge libmunge2 libslurm-dev \
                gcc make python3-venv python3-dev chromium prometheus victoria-metrics

export PATH := $(BIN):$(PATH)

.PHONY: help deps build test unit bench resilience demo down clean

help:
	@echo "make demo   a local Slurm cluster: a GPU fails under a training job, which recovers"
	@echo "make test   install, build, start a dev cluster, run every test, stop it"
	@echo "make unit   only the fast unit tests (no cluster)"
	@echo "make bench  hook, ingest, scanner, tailer, recovery and scale benchmarks (into docs/)"
	@echo "make resilience  the fault campaign, slow scenarios included (docs/resilience.md)"
	@echo "make down   stop the demo cluster"
	@echo "make deps   install Debian packages and the Python virtualenv"

deps: $(VENV)/.installed
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { \
	  echo "installing Debian packages: $(APT_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	    $(APT_PACKAGES); }

$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

build: deps
	$(MAKE) -s -C spank
	PATH=$(BIN):$$PATH $(MAKE) -s -C tests/fake_nvml

test: deps build
	@$(BIN)/recovery-devcluster up --state-dir $(TEST_STATE_DIR) --port $(TEST_PORT)
	@rc=0; RECOVERY_DEVCLUSTER_DIR=$(TEST_STATE_DIR) RECOVERY_TEST_PORT=$(TEST_PORT) \
	  $(BIN)/python -m pytest $(PYTEST_ARGS) || rc=$$?; \
	  $(BIN)/recovery-devcluster down --state-dir $(TEST_STATE_DIR); \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; \
	  exit $$rc

unit: deps
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: deps build
	@mkdir -p docs
	$(BIN)/python -m tests.benchmarks.bench_hooks --out docs/benchmarks-hooks.md
	$(BIN)/python -m tests.benchmarks.bench_scanner | tee docs/benchmarks-scanner.md
	$(BIN)/python -m tests.benchmarks.bench_tail --out docs/benchmarks-tail.md
	$(BIN)/python -m tests.benchmarks.bench_recovery --out docs/benchmarks-recovery.md
	$(BIN)/python -m tests.benchmarks.bench_scale --out docs/benchmarks-scale.md
	$(BIN)/python -m tests.benchmarks.bench_burst --out docs/benchmarks-burst.md
	$(BIN)/python -m tests.benchmarks.summary | tee docs/benchmarks.md

resilience: deps build
	@$(BIN)/recovery-devcluster up --state-dir $(TEST_STATE_DIR) --port $(TEST_PORT)
	@rc=0; RECOVERY_DEVCLUSTER_DIR=$(TEST_STATE_DIR) RECOVERY_TEST_PORT=$(TEST_PORT) \
	  $(BIN)/python -m pytest -m resilience --resilience-report docs/resilience.md \
	  $(PYTEST_ARGS) || rc=$$?; \
	  $(BIN)/recovery-devcluster down --state-dir $(TEST_STATE_DIR); \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; \
	  exit $$rc

demo: deps build
	DEMO_STATE_DIR=$(DEMO_STATE_DIR) bash contrib/demo/demo.sh

down:
	$(BIN)/recovery-devcluster down --state-dir $(DEMO_STATE_DIR)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	$(MAKE) -s -C spank clean
