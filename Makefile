# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
DATA   ?= data/knowledge_world
# One OpenMP thread per process keeps multi-rank tests from oversubscribing 2 cores.
TEST_ENV := OMP_NUM_THREADS=1 PYTHONHASHSEED=0

.PHONY: install demo test test-all bench lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --upgrade -q pip
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m rag_mm.data.knowledge_world out=$(DATA)
	$(PY) -m rag_mm.train +experiment=demo data.root=$(DATA)

test: install
	$(TEST_ENV) $(PY) -m pytest -q -m "not gpu and not slow" --durations=25

test-all: install
	$(TEST_ENV) $(PY) -m pytest -q

bench: install
	$(PY) scripts/bench/run_all.py

lint: install
	$(PY) -m ruff check rag_mm retriever parallel scripts tests

clean:
	rm -rf outputs runs build data .pytest_cache
