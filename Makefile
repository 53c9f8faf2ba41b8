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

# The GPU check's CPU paths: the wheels a lent GPU machine would get are all there and fit the
# transfer limit (it exits 0 with no GPU; on a GPU machine it runs every GPU check), and every step
# of the check run on the CPU (gpu-check-dry); then the tests, last, so that their summary closes
# the output (the dry run's `pytest -m gpu` skips everything here). The CUDA build is not part of
# it (minutes when its cache is cold): `make cuda-build`, which CI runs too.
test: install gpu-wheels
	$(PY) scripts/gpu_check.py --out runs/gpu_check
	$(MAKE) --no-print-directory gpu-check-dry
	$(TEST_ENV) $(PY) -m pytest -q -m "not gpu and not slow" --durations=25

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

clean:
	rm -rf outputs runs build data .pytest_cache

# GPU checks on a lent GPU machine (torch there, no network). Here: `make gpu-wheels` fills
# $(GPU_WHEELS) (ignored by git: carry it); there: `make gpu-check` installs from it what is
# missing and runs scripts/gpu_check.py (results in $$OUT). `make gpu-check-dry`: the same steps on
# this machine's CPU. GPU_PYVER=3.12 downloads for another python; GPU_ARGS="--only pytest" etc.
# GPU_PY is the one program looked up on PATH (give its full path to avoid even that): every
# step runs through it (torchrun as `$(GPU_PY) -m torch.distributed.run`).
GPU_WHEELS  ?= .gpu_wheels
GPU_PYVER   ?=
GPU_PY      ?= python3
GPU_OUT     ?= $(or $(OUT),runs/gpu_check)
GPU_ARGS    ?=
GPU_MODULES := numpy faiss pytest ninja yaml omegaconf hydra webdataset ftfy regex safetensors \
	tokenizers huggingface_hub transformers timm open_clip

.PHONY: gpu-wheels gpu-check gpu-check-dry

gpu-wheels: install
	PY=$(PY) bash scripts/gpu_wheels.sh download $(GPU_WHEELS) $(GPU_PYVER)

gpu-check:
	$(GPU_PY) -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' \
		$(GPU_MODULES) || bash scripts/gpu_wheels.sh install $(GPU_WHEELS) $(GPU_PY)
	$(GPU_PY) scripts/gpu_check.py --out $(GPU_OUT) $(GPU_ARGS)

gpu-check-dry: install
	$(PY) scripts/gpu_check.py --dry-run --out runs/gpu_check_dry $(GPU_ARGS)
