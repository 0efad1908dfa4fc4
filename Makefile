# Every command a user needs; each creates .venv and installs what it needs.
#   make demo        the main job: the ring on real MPI processes, with its work table
#   make test        the test suite (what CI runs)
#   make notebooks   execute the step-through notebooks and save them as notebooks/NN_*.ipynb
#   make bench       benchmarks -> BENCHMARKS.md and bench/results/
#   make gpu-check   GPU tests and benchmark table (on a machine with a CUDA 13 GPU)
#   make conformance other projects' ring attention against the oracle -> CONFORMANCE.md
#                    (its own venv, peers/.venv, with torch on the CPU; never part of make test)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
RANKS  ?= 4
export MPIEXEC_TIMEOUT ?= 600

.PHONY: demo test notebooks bench gpu-check conformance clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpi,test,notebooks]'
	touch $@

demo: $(VENV)/.installed
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m mpi4py -m mpi_impl --layout all --check --seq-len 8192 --tile-size 256 --repeat 2

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

PEERS_VENV := peers/.venv
CONFORMANCE ?= --examples 40

$(PEERS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q -e '.[peers]'
	touch $@

conformance: $(PEERS_VENV)/.installed
	OMP_NUM_THREADS=1 $(PEERS_VENV)/bin/python -m peers.conformance $(CONFORMANCE)

clean:
	rm -rf $(VENV) $(PEERS_VENV) .pytest_cache .hypothesis
