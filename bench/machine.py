"""What a benchmark says about the machine it ran on, written once: the CPU,
the BLAS and its kernels, the float32 matmul rate, the thread settings.

Every section names its machine with these (CPUs differ in how element-wise
work compares with BLAS), and `bench.run` writes them at the top of
BENCHMARKS.md.

    from bench.machine import cpu_name, blas_name, matmul_rate
    print(cpu_name(), blas_name(), matmul_rate(3) / 1e9, "GFLOP/s")
"""

import io
import os
import platform
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np

from reference.cores import blas_description

MATMUL_N = 4096
BLAS_IDLE_S = 0.5      # OpenBLAS's idle threads spin for a while after a product: let them settle
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")   # they change BLAS timings


def cpu_name():
    """The CPU's model name and its widest vector extension: 'AMD EPYC (AVX-512)'."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = text.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    return f"{name} ({vector})" if vector else name


def blas_name():
    """The BLAS that ran, with its kernels and threads (threadpoolctl)."""
    return blas_description()


# OpenBLAS reads these as it loads: some machines set them to older kernels (Haswell's on
# an AVX-512 CPU), which handicaps sgemm and every share of its rate measured against it
KERNEL_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def rerun_with_machine_kernels(module, argv, env=None):
    """Where OPENBLAS_CORETYPE or OPENBLAS_L2_SIZE is set, run ``python -m
    module argv`` again without both (for that command only, so that sgemm
    and the steps use the machine's own kernels) and return its exit status;
    None where neither is set."""
    env = os.environ if env is None else env
    found = [f"{name}={env[name]}" for name in KERNEL_ENV if name in env]
    if not found:
        return None
    print(f"  {module}: measuring with the machine's own BLAS kernels: running again without "
          f"{' and '.join(found)} (--as-set keeps them)", file=sys.stderr, flush=True)
    child = {k: v for k, v in env.items() if k not in KERNEL_ENV}
    return subprocess.call([sys.executable, "-m", module, *argv, "--unset", ",".join(found)], env=child)


def kernels_note(unset):
    """What the report says about the kernels' environment (`unset`: the --unset of the rerun)."""
    if unset:
        return f" (the machine's own kernels: {unset.replace(',', ' and ')} unset for this command)"
    set_ = [f"{name}={os.environ[name]}" for name in KERNEL_ENV if name in os.environ]
    return f" (**{' and '.join(set_)} set: not the machine's own kernels**)" if set_ else ""


def blas_info():
    """BLAS that numpy was built with, from numpy.show_config (numpy >= 1.25) or its text."""
    import numpy as np
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        extra = blas.get("openblas configuration", "")
        return f"{blas.get('name', '?')} {blas.get('version', '')}".strip() + (f" ({extra})" if extra else "")
    except Exception:      # older numpy: no mode=, print the text and take the blas lines
        buf = io.StringIO()
        with redirect_stdout(buf):
            np.show_config()
        lines = [ln.strip() for ln in buf.getvalue().splitlines() if "blas" in ln.lower()]
        return "; ".join(lines[:3]) or "unknown"


def blas_limit_note(env=None, cores=None):
    """A warning when the environment holds BLAS below the cores (the matmul
    rate is then a share of the machine, and the ratios are inflated), else ''."""
    env, cores = os.environ if env is None else env, os.cpu_count() if cores is None else cores
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) < cores:
            return (f"**{name}={value} was set:** the matmul rate above is that of {value} of the {cores} cores, "
                    "so the shares below are not of the machine's rate; run without it.")
    return ""


def matmul_rate(repeats, n=MATMUL_N):
    """Best float32 FLOP/s of an n-square product over `repeats` tries."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a                                                 # warm up the BLAS threads
    rate = 2 * n ** 3 / best_time(lambda: a @ a, repeats)
    time.sleep(BLAS_IDLE_S)
    return rate


def best_time(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def thread_settings():
    """The thread variables set in the environment, or that none is."""
    found = ", ".join(f"{k}={os.environ[k]}" for k in THREAD_VARS if k in os.environ)
    return found or "none set (BLAS picks its own)"
