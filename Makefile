# Every command a user needs; each creates .venv and installs what it needs.
#   make demo        the main job: the ring on real MPI processes, with its work table
#   make test        the test suite, within 4 minutes on 2 cores (what CI runs, with the next two)
#   make test-slow   the few tests that need minutes (marked slow: the prepared GPU check's scripts)
#   make test MPI=openmpi   the MPI tests again under Open MPI (its own venv, .venv-openmpi)
#   make train       train the small transformer over MPI ranks, draw its loss curve (train_loss.png)
#   make notebooks   execute the step-through notebooks, rewrite their executed copies notebooks/NN_*.ipynb
#   make bench       benchmarks -> BENCHMARKS.md and bench/results/
#   make gpu-wheels  the wheels a GPU machine without a package index needs -> .gpu-wheels/
#                    (for its Python: GPU_PYTHON=3.12, manylinux x86-64)
#   make gpu-check   the prepared GPU validation -> bench/results/gpu_check.md (a CUDA 13 GPU;
#                    installs nothing: GPU_CHECK="--wheels .gpu-wheels" installs those wheels first)
#   make wheel-check the built wheel, installed outside the checkout, runs (CI runs it)
#   make conformance other projects' ring attention against the oracle -> conformance/
#                    (CONFORMANCE.md and pages/), and the JAX ring of examples/ checked from the
#                    kit's command line (its own venv, conformance/.venv, with torch on the CPU;
#                    never part of make test; BPT=path/to/bpt.py adds the paper authors' JAX ring)

PYTHON ?= python3
RANKS  ?= 4
export MPIEXEC_TIMEOUT ?= 600

# Which MPI: mpich (the default, the `mpi` extra) or openmpi (the `openmpi`
# extra, in a venv of its own; `make test` then runs the tests that launch MPI).
MPI ?= mpich
MPI_TESTS := tests/mpi/test_mpi.py tests/mpi/test_backends.py tests/mpi/test_faults.py tests/mpi/test_cli_check.py tests/mpi/test_hazards.py tests/mpi/test_soak.py
ifeq ($(MPI),openmpi)
VENV   := .venv-openmpi
EXTRAS := openmpi,test
# Open MPI refuses to run as root, and to start more ranks than cores, unless told
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
TESTS  := $(MPI_TESTS)
else ifeq ($(MPI),mpich)
VENV   := .venv
EXTRAS := mpi,test,notebooks
MPI_ENV :=
TESTS  :=
else
$(error MPI must be mpich or openmpi, got '$(MPI)')
endif
PY     := $(VENV)/bin/python

.PHONY: demo train test test-slow notebooks bench gpu-check gpu-wheels wheel-check conformance clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

demo: $(VENV)/.installed
	$(MPI_ENV) OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n $(RANKS) $(PY) -m mpi4py -m mpi_impl --layout all --check --seq-len 8192 --tile-size 256 --repeat 2

# about a minute on 2 cores; TRAIN_ARGS=--help lists the options (python -m model --help)
TRAIN_RANKS ?= 2
TRAIN_ARGS  ?=
train: $(VENV)/.installed
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n $(TRAIN_RANKS) $(PY) -m mpi4py -m model --steps 300 $(TRAIN_ARGS)

# One pytest worker per core (pytest-xdist), and the slowest tests named at the end so
# that growth shows. pytest exits 5 when it collected no test: not a failure of the
# code (every other non-zero status is passed on). Tests marked slow run in test-slow.
CORES := $(shell $(PYTHON) -c 'import os; print(len(os.sched_getaffinity(0)))')
TEST_ARGS ?=
TEST_MARK ?= not slow
test: $(VENV)/.installed
	$(MPI_ENV) $(PY) -m pytest -q -n $(CORES) --durations=15 -m '$(TEST_MARK)' $(TEST_ARGS) $(TESTS) || { rc=$$?; [ $$rc -eq 5 ] || exit $$rc; }

test-slow: $(VENV)/.installed
	$(MAKE) test TEST_MARK=slow

notebooks: $(VENV)/.installed
	$(PY) scripts/run_notebooks.py --write

BENCH ?= --quick

bench: $(VENV)/.installed
	$(MAKE) .venv-openmpi/.installed MPI=openmpi      # the waits section's Open MPI rows
	$(PY) -m bench.run $(BENCH)

GPU_CHECK ?=
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= .gpu-wheels

# No .venv dependency: a GPU machine may have no package index. The script uses
# .venv/bin/python where it exists, else python3 with CuPy and mpi4py installed.
gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK)

# On a machine with an index, for the GPU machine's Python (scripts/gpu_wheels.py)
gpu-wheels: $(VENV)/.installed
	$(PY) scripts/gpu_wheels.py --dest $(GPU_WHEELS) --python-version $(GPU_PYTHON)

wheel-check: $(VENV)/.installed
	PYTHON=$(PY) bash scripts/wheel_check.sh

PEERS_VENV := conformance/.venv
CONFORMANCE ?= --examples 40
# the paper authors' JAX ring is a file, not a package: BPT=path/to/bpt.py adds its rows
# (exists-forall/striped_attention at 0c3ef0f; docs/kit.md)
BPT ?=

$(PEERS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q -e '.[peers]'
	touch $@

# the PyTorch harness's own tests first (skipped by make test, which has no torch), then the peers
conformance: $(PEERS_VENV)/.installed
	OMP_NUM_THREADS=1 $(PEERS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/kit/test_torch_harness.py tests/kit/test_conformance_runner.py
	BPT=$(BPT) OMP_NUM_THREADS=1 $(PEERS_VENV)/bin/python -m conformance $(CONFORMANCE)
	OMP_NUM_THREADS=1 $(PEERS_VENV)/bin/python -m reference.testing check examples/jax_ring.py:JaxRing --world-sizes 2,4 --examples 20
	OMP_NUM_THREADS=1 $(PEERS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/kit/test_jax_harness.py

clean:
	rm -rf .venv .venv-openmpi $(PEERS_VENV) .pytest_cache .hypothesis .gpu-venv
