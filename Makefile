# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DATA   ?= data/knowledge_world
# One OpenMP thread per process keeps multi-rank tests (several processes each) from
# oversubscribing the cores.
TEST_ENV := OMP_NUM_THREADS=1 PYTHONHASHSEED=0

.PHONY: install demo test test-all bench lint clean cuda-build

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade -q pip
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m rag_mm.data.knowledge_world out=$(DATA)
	$(PY) -m rag_mm.train +experiment=demo data.root=$(DATA)

# The tests of the default selection (CPU; gloo ranks for the distributed parts), after the
# install when it is not done yet. `make test-all` adds the slow ones.
# TEST_WORKERS pytest-xdist processes share the tests out. Most tests are one process on one
# OpenMP thread, so a serial run leaves the second of CI's two cores idle; a fixed count (not
# `-n auto`) because the multi-rank tests start their own ranks on top of the workers.
# TEST_WORKERS=0 runs them in this process, one after the other.
TEST_WORKERS ?= 2
test: install
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu and not slow" --durations=40

# Every CUDA source of csrc/ compiled for sm_80, sm_90 (and sm_100 when the toolkit has it) with
# nvcc from PyPI, installed under ~/.cache/rag_mm/cuda-toolkit (the venv is not touched), then
# loaded here, GPU or not, and its CUDA ops listed. Cached: a second run with nothing changed takes
# seconds. CUDA_BUILD_ARGS="--cuda-home auto" uses the machine's own toolkit instead.
CUDA_BUILD_ARGS ?=
cuda-build: install
	$(PY) scripts/cuda_build.py $(CUDA_BUILD_ARGS)

test-all: install
	$(TEST_ENV) $(PY) -m pytest -q

bench: install
	$(PY) scripts/bench/run_all.py

lint: install
	$(PY) -m ruff check rag_mm retriever parallel scripts tests
	$(PY) -m ruff format --check rag_mm retriever parallel scripts tests

clean:
	rm -rf outputs runs build data .pytest_cache

# The GPU checks on your own GPU machine (docs/development.md): scripts/gpu_check.py run by
# GPU_PY, the python that holds the machine's CUDA build of torch and the project's packages (the
# steps run from this tree: no install); results as JSON under GPU_OUT. GPU_ARGS="--only pytest"
# etc. picks steps. `make gpu-check-dry`: the same steps on this machine's CPU, a smoke test.
GPU_PY   ?= python3
GPU_OUT  ?= runs/gpu_check
GPU_ARGS ?=

.PHONY: gpu-check gpu-check-dry

gpu-check:
	$(GPU_PY) scripts/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)

gpu-check-dry: install
	$(PY) scripts/gpu_check.py --dry-run --out runs/gpu_check_dry $(GPU_ARGS)
