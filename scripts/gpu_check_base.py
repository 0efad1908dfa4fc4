"""make gpu-check's pieces every step shares: the sizes, a step's context and
result, and running a command within the step's time (scripts/gpu_check.py).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from mpi_impl.launch import OPEN_MPI_AS_ROOT  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "gpu_check.py"   # the steps launch its worker modes
OUT = ROOT / "bench" / "results" / "gpu_check.md"
QUEUED_GPU = ROOT / "tests" / "support" / "gpu" / "queued_device.py"
RANKS = 4
WHOLE_S = 9 * 60        # the whole check, wheels installed included (scripts/gpu_check.sh starts the clock):
                        # one command of a lent GPU (10 minutes), with a minute to spare
MARGIN_S = 20           # kept back for writing the results, and for killing a step that ran over
INSTALL_S = 45          # kept back for gpu_check.sh's install of carried wheels (--wheels), before the steps


@dataclass(frozen=True)
class Sizes:
    """What the steps run: a GPU's sizes, or small ones for --fake-gpu."""
    realistic: tuple        # the command line step's arguments
    traced: tuple           # the trace step's
    fused_seq: int          # the fused kernel against the readable step: 4 striped blocks of fused_seq / 4
    fused_dims: tuple       # head dims
    rate_block: int         # the rates: one block pair of rate_block queries x keys
    checked: dict           # the checked run: seq_len, heads, kv_heads, head_dim, tile (striped, float16)


GPU_SIZES = Sizes(          # forward and backward at tiles fused_v2 takes (auto picks it both ways)
    realistic=("--seq-len", "16384", "--head-dim", "128", "--dtype", "float16", "--kv-heads", "1", "--heads", "2",
               "--layout", "striped", "--backward", "--check", "--tile-size", "64x64", "--backward-tile-size", "32x64",
               "--no-warmup"),
    traced=("--seq-len", "65536", "--head-dim", "128", "--dtype", "float16", "--heads", "8", "--kv-heads", "2",
            "--layout", "all", "--backward", "--tile-size", "32x64", "--backward-tile-size", "16x64", "--repeat", "2"),
    fused_seq=1024, fused_dims=(64, 128), rate_block=4096,
    checked=dict(seq_len=65536, heads=8, kv_heads=2, head_dim=128, tile=(32, 64), backward_tile=(16, 64)))
FAKE_SIZES = Sizes(
    realistic=("--seq-len", "256", "--head-dim", "16", "--dtype", "float16", "--kv-heads", "1", "--heads", "2",
               "--layout", "striped", "--backward", "--check", "--tile-size", "32", "--no-warmup"),
    traced=("--seq-len", "256", "--head-dim", "16", "--dtype", "float16", "--heads", "8", "--kv-heads", "2",
            "--layout", "all", "--backward", "--tile-size", "32", "--repeat", "2"),
    fused_seq=64, fused_dims=(64, 128), rate_block=32,
    checked=dict(seq_len=256, heads=8, kv_heads=2, head_dim=16, tile=32, backward_tile=32))
FUSED_DTYPES = (np.float32, np.float16)


@dataclass
class Context:
    dry: bool
    python: str
    mpiexec: str
    work: Path
    fake: bool = False
    deadline: float = float("inf")      # time.time() by which this step's commands must have ended
    notes: dict = field(default_factory=dict)

    @property
    def sizes(self):
        return FAKE_SIZES if self.fake else GPU_SIZES

    def left(self):
        """Seconds left to this step."""
        return self.deadline - time.time()

    def gpu_python(self):
        """The interpreter, and on a fake GPU the runner that installs one in every process."""
        return [self.python, str(QUEUED_GPU)] if self.fake else [self.python]


@dataclass
class Result:
    ok: bool
    text: str
    skipped: str = ""           # a reason: the step could not run here (a tool is missing)


# -- helpers -------------------------------------------------------------------------

def run(ctx, cmd, limit):
    """(returncode, stdout + stderr) of cmd, or (124, what it printed) once
    `limit` seconds or the step's time left (the smaller) have passed; its whole
    process group (mpiexec and its ranks) is killed then."""
    timeout = min(limit, ctx.left())
    if timeout < 1:
        return 124, "[not started: no time left]"
    full_env = _environment(timeout)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n[timed out after {timeout:.0f} s]"
    return proc.returncode, out


def _environment(timeout):
    env = dict(os.environ)
    for name, value in OPEN_MPI_AS_ROOT.items():
        env.setdefault(name, value)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
               OPENBLAS_NUM_THREADS=os.environ.get("OPENBLAS_NUM_THREADS", "4"),
               MPIEXEC_TIMEOUT=str(max(1, int(timeout) - 5)))    # mpiexec ends its ranks first
    return env


def run_all(ctx, cmds, limit):
    """[(returncode, stdout + stderr)] of commands run side by side, each
    killed with its process group (124) once `limit` seconds or the step's
    time left (the smaller) have passed."""
    timeout = min(limit, ctx.left())
    if timeout < 1:
        return [(124, "[not started: no time left]")] * len(cmds)
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_environment(timeout), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for cmd in cmds]
    end, results = time.time() + timeout, []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, end - time.time()))
            results.append((proc.returncode, out))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            results.append((124, (out or "") + f"\n[timed out after {timeout:.0f} s]"))
    return results


def fenced(text, limit=60):
    lines = text.strip().splitlines()
    if len(lines) > limit:
        lines = lines[:10] + [f"... ({len(lines) - limit} lines left out) ..."] + lines[-(limit - 10):]
    return "```\n" + "\n".join(lines) + "\n```"


def mpirun(ctx, *args):
    return [ctx.mpiexec, "-n", str(RANKS), *ctx.gpu_python()[:1], "-m", "mpi4py", *ctx.gpu_python()[1:], *args]


def find_sanitizer():
    for candidate in (shutil.which("compute-sanitizer"),
                      *(Path(p) / "bin" / "compute-sanitizer" for p in
                        (os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"))):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def module_version(name):
    try:
        module = __import__(name)
    except Exception as e:      # noqa: BLE001 - reported, not raised
        return f"missing ({type(e).__name__}: {e})"
    return getattr(module, "__version__", "present")


