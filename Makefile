# make demo   installs minispec into .venv and runs the SmolLM2 demo
# make test   installs minispec with its dev extras into .venv and runs the tests, the notebooks (fast mode)
#             and the row-invariance tests again on MKL's AVX2 kernels
# make lab    installs JupyterLab too (the course extra) and opens the notebooks
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: torch install demo lab test check-env clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: on a machine without an NVIDIA GPU, PyTorch's CPU wheels (a fraction of the CUDA build's
# size); where that index cannot be reached, PyPI's default build. An installed torch is kept.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
torch: $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then :; \
	elif command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "torch>=2.5"; \
	else echo "no NVIDIA GPU: installing PyTorch's CPU build from $(TORCH_CPU_INDEX)"; \
	  $(BIN)/pip install -q --timeout 15 --retries 1 "torch>=2.5" --index-url $(TORCH_CPU_INDEX) || \
	  { echo "$(TORCH_CPU_INDEX) not reachable: installing torch from the default index (may be a CUDA build)"; \
	    $(BIN)/pip install -q "torch>=2.5"; }; fi

install: torch
	$(BIN)/pip install -q -e ".[dev]"

demo: install
	$(BIN)/python -m minispec demo

# the course in a browser: JupyterLab (the course extra) on the notebooks folder
lab: torch
	$(BIN)/pip install -q -e ".[dev,course]"
	$(BIN)/jupyter lab notebooks

check-env: install
	$(BIN)/python -m minispec check-env

# check-env is not run on its own here: tests/test_cli.py runs the command and checks its report.
# JOBS parallel pytest workers (pytest-xdist) run the tests and the notebooks (fast mode) in one session:
# the notebooks, the longest items, are listed first, and a worker that runs out of items steals from the
# other (worksteal), so neither sits idle at the end; each worker (and each notebook's kernel) computes on
# one torch thread. The model is fetched and converted once before they start
JOBS ?= 2
# a notebook cell may take 600 s before it counts as hung (the slowest fast-mode cells take a few minutes on
# a loaded 2-core machine). A hung notebook (a kernel idle, nbmake waiting for a reply that never comes) has
# been seen with ipykernel 7 in CI and, once, with ipykernel 6.31 on a machine loaded by two trainings: such
# a notebook, and only one that timed out, runs once more (pytest-rerunfailures); a notebook that fails on
# its own merits fails both times
test: install
	$(BIN)/python tools/make_exercises.py --check
	$(BIN)/python -c "from minispec.loading import ensure_smollm2; ensure_smollm2()"
	MINISPEC_FAST=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(JOBS) --dist worksteal --durations=25 \
	  --nbmake --nbmake-timeout=600 --reruns 1 --only-rerun "timed out" -m "not two_threads" notebooks tests
	@# the tests that compute on two torch threads, alone: beside a busy worker two threads wait on each other
	$(BIN)/python -m pytest -n 0 -q -m two_threads tests
	@# row invariance again on MKL's AVX2 kernels (what an AVX2-only CPU runs): the probes must find the plans
	@# that path needs. Where the CPU has nothing wider than AVX2, the run above already took that path
	@cap=$$($(BIN)/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'); \
	if [ "$$cap" = AVX2 ]; then echo "CPU capability AVX2: the tests above ran on MKL's AVX2 kernels already"; \
	else MKL_ENABLE_INSTRUCTIONS=AVX2 $(BIN)/python -m pytest -n $(JOBS) -q tests/test_invariance.py tests/test_linear.py \
	  tests/test_compile.py; fi

# the course as HTML with outputs and figures (fast mode): build/book/index.html
.PHONY: book
book: install
	$(BIN)/python tools/book.py --out build/book

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
