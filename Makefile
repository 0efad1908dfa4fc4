# Every command a user needs; each creates .venv and installs what it needs.
#   make demo        the main job: the ring on real MPI processes, with its work table
#   make train       train the small transformer over MPI ranks, draw its loss curve (train_loss.png)
#   make test        the test suite (what CI runs)
#   make notebooks   execute the step-through notebooks and save them as notebooks/NN_*.ipynb
#   make bench       benchmarks -> BENCHMARKS.md and bench/results/
#   make gpu-check   GPU tests and benchmark table (on a machine with a CUDA 13 GPU)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RANKS  ?= 4
export MPIEXEC_TIMEOUT ?= 600

.PHONY: demo train test notebooks bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpi,test,notebooks]'
	touch $@

demo: $(VENV)/.installed
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m mpi4py -m mpi_impl --layout all --check --seq-len 8192 --tile-size 256 --repeat 2

# about a minute on 2 cores; TRAIN_ARGS=--help lists the options (python -m model --help)
TRAIN_RANKS ?= 2
TRAIN_ARGS  ?=
train: $(VENV)/.installed
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n $(TRAIN_RANKS) $(PY) -m mpi4py -m model --steps 300 $(TRAIN_ARGS)

# pytest exits 5 when it collected no test: not a failure of the code (every other
# non-zero status is passed on).
test: $(VENV)/.installed
	$(PY) -m pytest -q || { rc=$$?; [ $$rc -eq 5 ] || exit $$rc; }

notebooks: $(VENV)/.installed
	$(PY) scripts/run_notebooks.py --write

BENCH ?= --quick

bench: $(VENV)/.installed
	$(PY) -m bench.run $(BENCH)

gpu-check: $(VENV)/.installed
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
