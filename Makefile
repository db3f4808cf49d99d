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
# make resilience RUNS=N: every scenario of the campaign N times (docs/resilience.md)
RUNS           ?= 1
# make test REST=1: the dev cluster also runs slurmrestd, and the REST contract runs
REST           ?= 0
REST_STATE_DIR ?= /tmp/recovery-rest-cluster-$(UID)
REST_PORT      ?= 27817
# ... in SHARDS pytest runs at once, each on a dev cluster of its own (ports 5000 apart)
SHARDS         ?= 1

APT_PACKAGES := slurm-wlm slurmctld slurmd slurm-client munge libmunge2 libslurm-dev \
                slurmrestd slurm-wlm-jwt-plugin gcc make python3-venv python3-dev chromium prometheus victoria-metrics \
                openssh-server openssh-client

export PATH := $(BIN):$(PATH)

.PHONY: help deps build test test-rest unit bench resilience demo down clean

help:
	@echo "make demo   a local Slurm cluster: a GPU fails under a training job, which recovers"
	@echo "make test   install, build, start a dev cluster, run every test, stop it"
	@echo "make unit   only the fast unit tests (no cluster)"
	@echo "make test-rest  the scheduler contract through slurmrestd (REST=1 adds it to make test)"
	@echo "make bench  hook, ingest, scanner, tailer, recovery and scale benchmarks (into docs/)"
	@echo "make resilience [RUNS=20]  the fault campaign, slow scenarios included, every"
	@echo "            scenario RUNS times (default 1) into docs/resilience.md; fails on any failed run"
	@echo "make down   stop the demo cluster"
	@echo "make deps   install Debian packages and the Python virtualenv"
	@echo "make install [PREFIX=/opt/slurm-recovery] [DESTDIR=]  site install (docs/install.md)"
	@echo "make uninstall  remove what make install added (keeps a changed config and the store)"
	@echo "make deb    dist/slurm-recovery_<version>_<arch>.deb for apt install"
	@echo "make install-test  the .deb in a debootstrap chroot of Debian 12 (root, a few minutes)"
	@echo "make bench-slurm [SLURM=...]  the recovery benchmark on 22.05, 24.11 and 26.05"
	@echo "make test-slurm [SLURM=24.11|26.05|22.05] [SUITES=contract recovery ...]  the live"
	@echo "            suites on another Slurm, in a debootstrap chroot (root; docs/slurm-versions.md)"

deps: $(VENV)/.installed
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { \
	  echo "installing Debian packages: $(APT_PACKAGES)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	    $(APT_PACKAGES); }

# the product and, beside it, the developer tools (tools/: the dev cluster, the docs
# generators), which the product's wheel, make install and the .deb leave out
$(VENV)/.installed: pyproject.toml tools/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]' -e tools
	@touch $@

build: deps
	$(MAKE) -s -C spank
	PATH=$(BIN):$$PATH $(MAKE) -s -C tests/fake_nvml

test: deps build
	@RECOVERY_DEVCLUSTER_REST=$(REST) $(BIN)/recovery-devcluster up --state-dir $(TEST_STATE_DIR) \
	  --port $(TEST_PORT)
	@rc=0; RECOVERY_DEVCLUSTER_REST=$(REST) \
	  RECOVERY_DEVCLUSTER_DIR=$(TEST_STATE_DIR) RECOVERY_TEST_PORT=$(TEST_PORT) \
	  $(BIN)/python -m pytest $(PYTEST_ARGS) || rc=$$?; \
	  $(BIN)/recovery-devcluster down --state-dir $(TEST_STATE_DIR); \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; \
	  exit $$rc

# the CLI and REST contracts side by side, then the recovery loop with the agent on
# the REST backend, on a dev cluster of their own with slurmrestd
test-rest: deps build
	@$(BIN)/recovery-devcluster up --rest --state-dir $(REST_STATE_DIR) --port $(REST_PORT)
	@rc=0; export RECOVERY_DEVCLUSTER_REST=1 RECOVERY_DEVCLUSTER_DIR=$(REST_STATE_DIR) \
	  RECOVERY_TEST_PORT=$(REST_PORT); \
	  $(BIN)/python -m pytest $(PYTEST_ARGS) tests/integration/test_scheduler_contract.py \
	    tests/integration/test_scheduler_contract_rest.py || rc=$$?; \
	  RECOVERY_SCHEDULER_BACKEND=rest RECOVERY_SCHEDULER_REST_USER=$$(id -un) \
	  RECOVERY_SCHEDULER_REST_URL=http://127.0.0.1:$$(($(REST_PORT) + 80)) \
	  RECOVERY_SCHEDULER_REST_TOKEN_FILE=$(REST_STATE_DIR)/etc/rest.token \
	    $(BIN)/python -m pytest $(PYTEST_ARGS) tests/integration/test_recovery_live.py \
	    || rc=$$?; \
	  $(BIN)/recovery-devcluster down --state-dir $(REST_STATE_DIR); exit $$rc

unit: deps
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

bench: deps build
	@mkdir -p docs
	$(BIN)/python -m tests.benchmarks.bench_hooks --out docs/benchmarks-hooks.md
	$(BIN)/python -m tests.benchmarks.bench_scanner | tee docs/benchmarks-scanner.md
	$(BIN)/python -m tests.benchmarks.bench_tail --out docs/benchmarks-tail.md
	$(BIN)/python -m tests.benchmarks.bench_recovery --out docs/benchmarks-recovery.md \
	  --json build/bench-recovery.json
	$(BIN)/python -m tests.benchmarks.bench_scale --out docs/benchmarks-scale.md
	$(BIN)/python -m tests.benchmarks.bench_burst --out docs/benchmarks-burst.md
	$(BIN)/python -m tests.benchmarks.summary | tee docs/benchmarks.md

resilience: deps build
	@BIN=$(BIN) RUNS=$(RUNS) SHARDS=$(SHARDS) TEST_STATE_DIR=$(TEST_STATE_DIR) \
	  TEST_PORT=$(TEST_PORT) PYTEST_ARGS="$(PYTEST_ARGS)" bash tests/resilience_campaign.sh

demo: deps build
	DEMO_STATE_DIR=$(DEMO_STATE_DIR) bash contrib/demo/demo.sh

down:
	$(BIN)/recovery-devcluster down --state-dir $(DEMO_STATE_DIR)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	$(MAKE) -s -C spank clean

# ---- site installation (docs/install.md) -----------------------------------
# make install [PREFIX=/opt/slurm-recovery] [DESTDIR=/tmp/stage]: a self-contained
# virtualenv at PREFIX with the agent, recovery-ctl and the hooks (from a wheel
# built from this checkout), links to recovery-ctl and recovery-agent in BINDIR and
# SBINDIR, the SPANK plugin and its plugstack.conf.d line, the hook wrappers, the
# systemd units and /etc/slurm-recovery/recovery.toml (never overwritten). make
# uninstall removes it again; make deb packages it for Debian.
PREFIX           ?= /opt/slurm-recovery
SYSCONFDIR       ?= /etc
SYSTEMD_UNIT_DIR ?= /lib/systemd/system
PLUGSTACK_DIR    ?= /etc/slurm/plugstack.conf.d
# the links that put recovery-ctl and recovery-agent on PATH (make deb: /usr/bin, /usr/sbin)
BINDIR           ?= /usr/local/bin
SBINDIR          ?= /usr/local/sbin
# the interpreter the virtualenv runs on, at the same path on every host: Debian's
INSTALL_PYTHON   ?= /usr/bin/python3
# optional extras (EXTRAS=fast adds hyperscan) and pip options (PIP_ARGS='--no-index
# --find-links wheels' installs offline)
EXTRAS           ?=
PIP_ARGS         ?=
VERSION          := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# the package's version: VERSION and a Debian revision, from the changelog's top
# entry (packaging/debian/build-deb.sh refuses one that is not VERSION-N)
DEB_VERSION      := $(shell head -n 1 packaging/debian/changelog | cut -d' ' -f2 | tr -d '()')
DEB_ARCH         := $(shell dpkg --print-architecture 2>/dev/null || echo amd64)
DEB              := dist/slurm-recovery_$(DEB_VERSION)_$(DEB_ARCH).deb
# COMPILE=0: no bytecode in the tree (make deb: its postinst compiles it)
COMPILE          ?= 1
INSTALL_ENV       = DESTDIR='$(DESTDIR)' PREFIX='$(PREFIX)' SYSCONFDIR='$(SYSCONFDIR)' \
                    SYSTEMD_UNIT_DIR='$(SYSTEMD_UNIT_DIR)' PLUGSTACK_DIR='$(PLUGSTACK_DIR)' \
                    BINDIR='$(BINDIR)' SBINDIR='$(SBINDIR)' \
                    INSTALL_PYTHON='$(INSTALL_PYTHON)' EXTRAS='$(EXTRAS)' PIP_ARGS='$(PIP_ARGS)' \
                    BUILD_DIR='$(CURDIR)/build/install' FORCE='$(FORCE)' COMPILE='$(COMPILE)'

.PHONY: install uninstall deb install-test

install:
	@$(MAKE) -s -C spank || { echo "the SPANK plugin needs gcc and libslurm-dev" \
	  "(apt-get install gcc make libslurm-dev python3-venv)" >&2; exit 1; }
	@$(INSTALL_ENV) sh packaging/install.sh install

uninstall:
	@$(INSTALL_ENV) sh packaging/install.sh uninstall

deb:
	@rm -rf build/deb
	@$(MAKE) -s install DESTDIR=$(CURDIR)/build/deb/root COMPILE=0 BINDIR=/usr/bin SBINDIR=/usr/sbin
	@PREFIX='$(PREFIX)' SYSCONFDIR='$(SYSCONFDIR)' PLUGSTACK_DIR='$(PLUGSTACK_DIR)' \
	  VERSION='$(VERSION)' ARCH='$(DEB_ARCH)' sh packaging/debian/build-deb.sh \
	  build/deb/root $(DEB)

# the .deb in a fresh debootstrap chroot of Debian 12, down to a dev cluster that
# recovers a job with the installed hooks, and lintian over it (needs root and the
# Debian mirror; about two minutes, one with the chroot cached in
# build/install-test/): pytest -m install
install-test: deps deb
	@command -v debootstrap >/dev/null && command -v lintian >/dev/null || \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	  debootstrap lintian
	RECOVERY_DEB=$(CURDIR)/$(DEB) $(BIN)/python -m pytest -m install \
	  tests/integration/test_install_chroot.py $(PYTEST_ARGS)

# ---- the live suites on other Slurm releases (docs/slurm-versions.md) ------
# make test-slurm SLURM=24.11: the contract, recovery, SPANK, hooks and fault
# suites against Debian trixie's Slurm 24.11 in a debootstrap chroot (26.05:
# sid; 22.05: this host's own Slurm). No SLURM: the whole matrix, one after the
# other. Needs root and the Debian mirror the first time; the chroot and its
# virtualenv are cached as tarballs in SLURM_CHROOT_CACHE.
SLURM              ?=
SLURM_MATRIX       ?= 22.05 24.11 26.05
SUITES             ?= contract recovery spank hooks faults rest-loop
SLURM_CHROOT_CACHE ?= $(CURDIR)/build/slurm-chroots
SLURM_MATRIX_PORT  ?= 27817

# make bench-slurm [SLURM=...]: the recovery benchmark on each release (9 cases, no
# baseline), into the per-release table of docs/benchmarks-recovery.md
.PHONY: bench-slurm
bench-slurm: deps build
	@mkdir -p build
	@for v in $(or $(SLURM),$(SLURM_MATRIX)); do \
	  if [ $$v = 22.05 ]; then \
	    RECOVERY_BENCH_PORT=$(SLURM_MATRIX_PORT) $(BIN)/python -m tests.benchmarks.bench_recovery \
	      --cases 9 --baseline 0 --json build/bench-$$v.json || exit 1; \
	  else \
	    $(SUDO) env SLURM_CHROOT_CACHE='$(SLURM_CHROOT_CACHE)' SLURM_MATRIX_PORT='$(SLURM_MATRIX_PORT)' \
	      bash tests/slurm_matrix.sh $$v --run "cd /src && RECOVERY_BENCH_PORT=$(SLURM_MATRIX_PORT) \
	      python -m tests.benchmarks.bench_recovery --cases 9 --baseline 0 \
	      --json /src/build/bench-$$v.json" || exit 1; \
	  fi; \
	  $(BIN)/python -m tests.benchmarks.bench_recovery --add-version $$v build/bench-$$v.json; \
	done
	@if [ -f build/bench-recovery.json ]; then \
	  $(BIN)/python -m tests.benchmarks.bench_recovery --report-from build/bench-recovery.json \
	    --out docs/benchmarks-recovery.md >/dev/null; \
	  echo "docs/benchmarks-recovery.md: the per-release table updated"; \
	else echo "docs/benchmarks-recovery-versions.json updated; make bench writes the page"; fi

.PHONY: test-slurm
test-slurm: deps build
	@command -v debootstrap >/dev/null || \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends debootstrap
	@rc=0; for v in $(or $(SLURM),$(SLURM_MATRIX)); do \
	  $(SUDO) env SLURM_CHROOT_CACHE='$(SLURM_CHROOT_CACHE)' \
	    SLURM_MATRIX_PORT='$(SLURM_MATRIX_PORT)' BIN='$(BIN)' PYTEST_ARGS='$(PYTEST_ARGS)' \
	    bash tests/slurm_matrix.sh $$v $(SUITES) || rc=1; \
	done; exit $$rc
