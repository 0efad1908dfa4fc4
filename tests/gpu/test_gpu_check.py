"""make gpu-check and make gpu-wheels without a GPU: the prepared first GPU run cannot fail for want of Python.

- the wheels `make gpu-wheels` prepares (here for this machine's Python),
  installed by scripts/gpu_check.sh into a fresh venv that has neither pip nor
  NumPy: everything comes from the folder, mpi4py finds the mpich wheel's
  libmpi, and every step of the dry run starts;
- every step run for real (`--fake-gpu`) on a GPU made of NumPy
  (tests/support/gpu/queued_device.py) at small sizes: the commands the steps launch,
  their environment (Open MPI's root settings beside MPICH's mpiexec), the
  parsing of what they print; the GPU tests skip here, and the check says so
  and fails those two steps, as it must on a GPU;
- the results file is written after every step; a step starts only while time
  is left, and its commands are killed, process group and all, when it is up;
- the check's venv finds the machine's NVRTC and cuBLAS as CuPy 14 looks for
  them (cuda-pathfinder, over site.getsitepackages()), Debian's dist-packages too;
- the steps' limits sum within the cap (a lent GPU's 10-minute command), the
  kernels compiled first, every kernel checked and the sanitizer run before
  any timing, the long timings last; the dry run shows that plan;
- the environment step probes CUDA on a GPU only, and fails naming pytest or
  hypothesis where one is missing; gpu_check.sh --help names its own options;
- no GPU: status 2, nothing checked; no mpiexec: status 1, said.

    .venv/bin/python -m pytest tests/gpu/test_gpu_check.py -q
"""

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpu_impl

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
GPU_CHECK_PY = ROOT / "scripts" / "gpu_check.py"
GPU_WHEELS = ROOT / "scripts" / "gpu_wheels.py"
STEPS = ("environment", "compile", "kernels", "sanitizer", "race probe", "GPU tests", "checked run", "command line",
         "trace", "rates")


def _gpu_present():
    try:
        gpu_impl.require_cupy()
    except gpu_impl.GpuUnavailable:
        return False
    return True


GPU_PRESENT = _gpu_present()
without_gpu = pytest.mark.skipif(GPU_PRESENT, reason="a GPU is present (make gpu-check runs the real thing)")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def headings(text):
    """[(step, status)] of a results file's sections, in order."""
    pairs = [line[4:].split(": ", 1) for line in text.splitlines() if line.startswith("### ")]
    return [(name, status.rsplit(" (", 1)[0]) for name, status in pairs]


def section(text, name):
    start = text.index(f"### {name}:")
    end = text.find("\n### ", start + 1)
    return text[start:end if end > 0 else None]


@without_gpu
def test_gpu_check_script_fails_clearly_without_gpu(tmp_path):
    """No GPU: the script stops with status 2 and the reason, checking nothing."""
    proc = subprocess.run(["bash", str(GPU_CHECK), "--out", str(tmp_path / "r.md")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no usable GPU here, nothing was checked" in proc.stderr
    assert "== environment" not in proc.stdout and not (tmp_path / "r.md").exists()


def test_gpu_check_fails_without_mpiexec(tmp_path):
    """Without mpiexec the ring tests cannot run: the check fails (status 1),
    says so, and runs no further step."""
    out = tmp_path / "gpu_check.md"
    proc = subprocess.run(["bash", str(GPU_CHECK), "--dry-run", "--mpiexec", str(tmp_path / "no-mpiexec"),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = out.read_text()
    assert "mpiexec not found: the ring tests cannot run" in text and "FAILED: environment" in text
    assert "### race probe" not in text


def documented_command(*, wheels, out):
    """docs/gpu.md's one command for a lent GPU, as a list, its wheels folder
    and results file moved to `wheels` and `out` (everything else as written)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("bash scripts/gpu_check.sh ")]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    words[words.index("--wheels") + 1], words[words.index("--out") + 1] = str(wheels), str(out)
    assert words[:2] == ["bash", "scripts/gpu_check.sh"] and "--minutes" in words
    return words


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_wheels_install_into_a_fresh_venv_and_every_step_starts(tmp_path):
    """make gpu-wheels for this machine's Python (the GPU machine's is 3.12),
    then docs/gpu.md's one command (gpu_check.sh --wheels DIR --out FILE
    --minutes M) with --dry-run and the Python of a fresh venv
    that has no pip and no NumPy (where the GPU machine's has CuPy, NumPy and
    an mpi4py without MPI): the check's own venv gets every package from the
    folder with the carried pip, mpi4py loads the mpich wheel's libmpi (the MPI
    library row), mpiexec is the wheel's; and every step starts (tests
    collected, the command lines parse, the sanitizer's launch imports), each
    with a passing section, in order."""
    wheels, venv, check_venv, out = (tmp_path / name for name in ("wheels", "venv", "check-venv", "gpu_check.md"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run([sys.executable, str(GPU_WHEELS), "--dest", str(wheels), "--python-version", version],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {w.name.split("-")[0] for w in wheels.glob("*.whl")} >= {"mpich", "mpi4py", "numpy", "pytest", "pip",
                                                                     "hypothesis", "ml_dtypes", "pytest_timeout"}
    assert (wheels / "forced.txt").read_text().split() == ["mpi4py>=4.0", "mpich"]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    fresh = venv / "bin" / "python"
    assert subprocess.run([str(fresh), "-c", "import numpy"], capture_output=True).returncode != 0
    proc = subprocess.run(documented_command(wheels=wheels, out=out) + ["--python", str(fresh), "--venv",
                                                                       str(check_venv), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert text.startswith("Dry run (nothing measured)") and "every step passed" in text
    assert headings(text) == [(name, "ok") for name in STEPS], headings(text)
    env = section(text, "environment")
    assert f"| python | {version}" in env and f"{check_venv}/bin/python" in env
    assert f"| mpiexec | {check_venv}/bin/mpiexec" in env and "| MPI library | MPICH" in env
    assert "test_gpu_ring_matches_reference[4-staged]" in text          # 4 ranks sharing the GPU
    assert "2 GPU tests collected" in text and "16 GPU tests collected" in text
    assert "--seq-len 16384 --head-dim 128 --dtype float16" in text and "--backward --check" in text


@without_gpu
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gpu_check_runs_every_step_on_a_queued_gpu(tmp_path):
    """--fake-gpu: every step for real, at small sizes, on a GPU made of NumPy:
    the environment table, the pytest runs of the GPU tests (which skip without
    a GPU, so these two steps fail, saying why: any skip fails), the fused
    kernel against the readable step (the readable step standing in for the
    kernel), the checked run against its float64 reference, the command line
    with --check and the trace under mpiexec (MPICH,
    with Open MPI's root settings in the environment), the sanitizer's launch,
    the rates."""
    out = tmp_path / "gpu_check.md"
    proc = subprocess.run(["bash", str(GPU_CHECK), "--fake-gpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=360)
    text = out.read_text()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert text.startswith("Fake GPU run (nothing measured)") and "FAILED: race probe, GPU tests." in text
    assert headings(text) == [("environment", "ok"), ("compile", "ok"), ("kernels", "ok"),
                              ("sanitizer", "skipped: compute-sanitizer not found"), ("race probe", "FAILED"),
                              ("GPU tests", "FAILED"), ("checked run", "ok"), ("command line", "ok"), ("trace", "ok"),
                              ("rates", "ok")], text
    assert "| GPU | 1 x QueuedDevice (NumPy)" in section(text, "environment")
    for name, count in (("race probe", 2), ("GPU tests", 16)):
        part = section(text, name)
        assert f"{count} skipped" in part and "needs a GPU" in part, part     # pytest ran them
        assert "FAILED: tests were skipped although a GPU is present" in part
    assert "| the readable step's CuPy kernels (float32, float64) |" in section(text, "compile")
    kernels = section(text, "kernels")      # v1, then v2 forward and backward (the readable step standing in)
    assert kernels.count("| ok |") == 4 + 16, kernels
    assert section(text, "checked run").count("| ok |") == 5                  # out, lse, dq, dk, dv
    cli = section(text, "command line")
    rows = [line.split() for line in cli.splitlines() if line.startswith("striped ")]
    assert len(rows) == 1 and float(rows[0][1]) < 1e-2, cli               # --check's max error, float16
    assert "forward+backward" in cli
    traced = section(text, "trace")
    assert "forward, striped: per round" in traced and "backward, striped: per round" in traced
    assert "One block's shift alone" in traced
    launches = section(text, "sanitizer")
    assert "one fused launch per dtype: done" in launches and "both backward kernels): done" in launches
    timed = section(text, "rates")
    assert timed.count("fused v1, its tile") == 2 and timed.count("fused v2, the kernel alone") == 4
    assert timed.count("fused v2 backward, the kernels alone") == 4, timed
    for line in proc.stdout.splitlines():           # each section was printed too
        if line.startswith("### "):
            assert line in text


def test_results_are_written_after_every_step(tmp_path):
    """The check killed after its first step (as a device lease ends) leaves
    that step's section in the results file, marked incomplete: the file is
    written before the section is printed."""
    out = tmp_path / "gpu_check.md"
    proc = subprocess.Popen([sys.executable, str(GPU_CHECK_PY), "--dry-run", "--only", "env", "race",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("### environment"):
                break
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.stdout.close()
        proc.wait(timeout=60)
    text = out.read_text()
    assert "INCOMPLETE (1 steps still to run)" in text.splitlines()[0]
    assert headings(text) == [("environment", "ok")]


def test_steps_start_only_while_time_is_left(tmp_path):
    """The whole run's --minutes (9) count from --started (gpu_check.sh passes its
    own start, before the wheels are installed): once they are spent no step
    starts, and each says how to rerun it alone; a longer cap lets it start."""
    out = tmp_path / "gpu_check.md"
    proc = subprocess.run([sys.executable, str(GPU_CHECK_PY), "--dry-run", "--started", str(time.time() - 600),
                           "--only", "kernels", "rates", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = out.read_text()
    assert headings(text) == [("kernels", "FAILED"), ("rates", "FAILED")]
    assert "not started: the whole run's 540 s are spent (rerun it alone: --only kernels)" in text
    proc = subprocess.run([sys.executable, str(GPU_CHECK_PY), "--dry-run", "--started", str(time.time() - 600),
                           "--minutes", "20", "--only", "kernels", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and headings(out.read_text()) == [("kernels", "ok")], proc.stdout + proc.stderr


def test_a_command_is_killed_with_its_process_group_when_the_step_time_is_up(tmp_path):
    """run() gives a command what is left of its step, then kills its whole
    process group (mpiexec's ranks with it): a background child of the command
    does not outlive it. Its environment carries Open MPI's root settings and
    an MPIEXEC_TIMEOUT below the time left."""
    gpu_check = load_gpu_check()
    ctx = gpu_check.Context(dry=False, python=sys.executable, mpiexec="mpiexec", work=tmp_path,
                            deadline=time.time() + 3)
    pid_file = tmp_path / "pid"
    rc, out = gpu_check.run(ctx, ["bash", "-c", f"sleep 120 >/dev/null 2>&1 & echo $! > {pid_file}; "
                                                f"echo $MPIEXEC_TIMEOUT $OMPI_ALLOW_RUN_AS_ROOT; wait"], limit=60)
    assert rc == 124 and "timed out after" in out
    timeout, as_root = out.split()[:2]
    assert int(timeout) <= 3 and as_root == "1"
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(100):                    # SIGKILL is sent; it lands at once, but not always before we look
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX":     # gone, or a zombie
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's background child outlived the step: {stat.read_text()}")


def fake_python(tmp_path, body):
    """An 'interpreter' that runs `body` (bash) whatever it is asked: the probe's stand-in."""
    path = tmp_path / "python"
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_the_environment_probe_fails_at_once_saying_what_to_set(tmp_path):
    """The environment step compiles one kernel and runs one matmul: a CuPy that
    imports but cannot reach NVRTC (CuPy 14's DynamicLibNotFoundError, as the
    check's venv met it) fails the step, naming CUDA_PATH and --python; the
    right answer passes; a wrong answer fails too."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_kernels as kernels
    gpu_check = load_gpu_check()

    def probe(body):
        ctx = gpu_check.Context(dry=False, python=fake_python(tmp_path, body), mpiexec="mpiexec", work=tmp_path,
                                deadline=time.time() + 60)
        return kernels.cuda_probe(ctx)

    ok, text = probe("echo 'cuda.pathfinder.DynamicLibNotFoundError: Failure finding \"libnvrtc.so\"' >&2; exit 1")
    assert not ok and "DynamicLibNotFoundError" in text and "CUDA_PATH" in text and "--python" in text
    ok, text = probe(f"echo '{kernels.PROBE_EXPECTED}'")
    assert ok and "NVRTC" in text
    ok, _ = probe("echo '2.0 64.0'")                  # a kernel that did not run
    assert not ok


class NumpyAsCupy:
    """NumPy under CuPy's names, for the check's GPU formulas on a CPU."""
    def __getattr__(self, name):
        return getattr(np, name)

    asnumpy = staticmethod(np.asarray)


def test_checked_runs_reference_is_the_dense_reference():
    """The checked run's float64 reference on the GPU (query chunks, GQA)
    equals reference.attention and attention_backward: a chunk boundary
    inside the sequence, 2 query heads per K/V head."""
    from reference import attention, attention_backward
    gpu_check = load_gpu_check()
    rng = np.random.default_rng(3)
    q, dout = (rng.standard_normal((1, 40, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 40, 2, 8)) for _ in range(2))
    got = gpu_check.dense_reference_gpu(NumpyAsCupy(), q[0], k[0], v[0], dout[0], chunk=16)
    out, lse = attention(q, k, v)
    want = dict(out=out[0], lse=lse[0], **dict(zip(("dq", "dk", "dv"),
                                                    (x[0] for x in attention_backward(q, k, v, out, lse, dout)))))
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-10, atol=1e-12, err_msg=name)


def bare_venv(path):
    """A venv without pip at path: its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site_dir)


def test_the_check_venv_finds_the_machine_packages_as_cupy_looks_for_them(tmp_path):
    """A machine venv (holding a package, and a .pth pointing at another folder)
    and the check's venv made from it as scripts/gpu_check.sh makes it: in the
    check's venv, site.getsitepackages() lists the machine's site-packages (where
    CuPy's cuda-pathfinder looks for NVRTC and cuBLAS), and the machine's .pth
    files are read. With the .pth of plain paths it wrote before, neither held."""
    machine, machine_site = bare_venv(tmp_path / "machine")
    (machine_site / "machine_lib.py").write_text("X = 1\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "pth_lib.py").write_text("Y = 2\n")
    (machine_site / "extra.pth").write_text(f"{extra}\n")
    check, check_site = bare_venv(tmp_path / "check")
    subprocess.run([str(machine), str(ROOT / "scripts" / "machine_pth.py"), str(check_site)], check=True, timeout=60)
    probe = ("import site, machine_lib, pth_lib; "
             f"print({str(machine_site)!r} in site.getsitepackages(), site.getsitepackages()[0])")
    out = subprocess.run([str(check), "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found, first = out.stdout.split()
    assert found == "True", out.stdout
    assert Path(first) == check_site, "the check venv's own packages must come first"


def test_cupys_library_lookup_finds_nvrtc_and_cublas_from_the_check_venv(tmp_path):
    """The GPU machine's case without a GPU: its interpreter holds cuda-pathfinder
    (what CuPy 14 finds NVRTC and cuBLAS with) and the CUDA wheels' libraries under
    nvidia/cu13/lib (here any loadable shared object under those names); from the
    check's venv, made as scripts/gpu_check.sh makes it, the lookup finds them in the
    machine's site-packages. With a .pth of plain paths it raised DynamicLibNotFoundError."""
    import cuda.pathfinder
    machine, machine_site = bare_venv(tmp_path / "machine")
    shutil.copytree(Path(cuda.pathfinder.__file__).parent, machine_site / "cuda" / "pathfinder")
    libs = machine_site / "nvidia" / "cu13" / "lib"
    libs.mkdir(parents=True)
    loadable = min(Path(np.__file__).parent.rglob("*.so"), key=lambda p: p.stat().st_size)
    for name in ("libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13"):
        shutil.copy(loadable, libs / name)
    check, check_site = bare_venv(tmp_path / "check")
    subprocess.run([str(machine), str(ROOT / "scripts" / "machine_pth.py"), str(check_site)], check=True, timeout=60)
    probe = ("from cuda.pathfinder import load_nvidia_dynamic_lib as load; "
             "print(*(load(name).abs_path for name in ('nvrtc', 'cublas')))")
    out = subprocess.run([str(check), "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(libs / "libnvrtc.so.13"), str(libs / "libcublas.so.13")], out.stdout


def test_the_checks_ring_runs_forward_through_the_tensor_core_kernel():
    """The checked run, the command line and the trace run a float16 forward and
    backward at tiles fused_v2 takes, so that "auto" picks it both ways on CuPy
    (where it is the default) and a lent GPU runs it inside a ring."""
    import types

    from mpi_impl import cli
    from reference import steps
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_base as base
    import gpu_impl.steps.fused_v2  # noqa: F401 - registers fused_v2
    cupy = types.ModuleType("cupy")                     # only its name is read
    sizes = base.GPU_SIZES
    for argv in (sizes.realistic, sizes.traced):
        args = cli.build_parser().parse_args(list(argv))
        call = steps.Call(args.dtype, args.head_dim, args.heads // args.kv_heads, args.tile_size)
        assert steps.check_step("auto", cupy, call=call).name == "fused_v2", argv
        assert args.backward
        backward = call._replace(tile_size=args.backward_tile_size)
        assert steps.check_step("auto", cupy, call=backward, backward=True).name == "fused_v2", argv
    c = sizes.checked
    call = steps.Call("float16", c["head_dim"], c["heads"] // c["kv_heads"], tuple(c["tile"]))
    assert steps.check_step("auto", cupy, call=call).name == "fused_v2"
    backward = call._replace(tile_size=tuple(c["backward_tile"]))
    assert steps.check_step("auto", cupy, call=backward, backward=True).name == "fused_v2"
    assert steps.check_step("auto", cupy, call=call._replace(tile_size=1024)).name == "v1"     # as it ran before


# -- the first run's order and limits -------------------------------------------------------

def test_the_steps_limits_fit_the_cap_in_the_order_a_first_run_needs():
    """Every step gets its whole limit: their sum, with the install of the
    wheels and the margin, is at most the cap (9 minutes, one 10-minute
    command of a lent GPU). The cheapest check of every kernel and the
    sanitizer come before any timing, the long timings last."""
    gpu_check = load_gpu_check()
    limits = [limit for _, _, limit in gpu_check.STEPS.values()]
    assert sum(limits) + gpu_check.INSTALL_S + gpu_check.MARGIN_S <= gpu_check.WHOLE_S <= 9 * 60
    order = list(gpu_check.STEPS)
    assert order[:3] == ["environment", "compile", "kernels"] and order[-1] == "rates"
    assert order.index("sanitizer") < min(order.index(n) for n in ("race probe", "GPU tests", "checked run", "rates"))


def test_the_dry_run_shows_each_limit_their_sum_and_the_backward_kernels_before_the_timings(tmp_path):
    """The dry run's plan names every step's limit and their sum within what
    the cap leaves; the kernels step checks both backward kernels; the results
    file holds the plan."""
    out = tmp_path / "gpu_check.md"
    proc = subprocess.run([sys.executable, str(GPU_CHECK_PY), "--dry-run", "--only", "kernels",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = proc.stdout.splitlines()[0]
    found = dict((name, int(s)) for name, s in (part.rsplit(" ", 2)[:2] for part in
                                                plan[len("Plan: "):plan.index(";")].split(", ")))
    assert list(found) == list(STEPS), plan
    assert f"; {sum(found.values())} s in all, within the 475 s the cap of 540 s leaves" in plan, plan
    text = out.read_text()
    assert plan in text and headings(text) == [("kernels", "ok")]
    assert "attend_block_v2_dkdv" in section(text, "kernels") and "attend_block_v2_dq" in section(text, "kernels")


def test_every_kernel_the_check_launches_is_compiled_first():
    """The compile step's builds hold every (kernel, Config) that the kernels,
    sanitizer, ring and rates steps launch, forward and backward, at the sizes
    of a GPU run: none of those steps compiles on its own time."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_base as base
    import gpu_check_kernels as kernels
    from gpu_impl.steps import fused, fused_v2
    built = {args for _, version, args in kernels.kernel_builds() if version == 2}
    v1 = {args for _, version, args in kernels.kernel_builds() if version == 1}
    c = base.GPU_SIZES.checked
    calls = [(d, g, None, b) for d in fused_v2.HEAD_DIMS for g in (2, 4) for b in (False, True)]   # checks, rates
    calls += [(c["head_dim"], c["heads"] // c["kv_heads"], tuple(c[t]), b)
              for t, b in (("tile", False), ("backward_tile", True))]
    for argv in (base.GPU_SIZES.realistic, base.GPU_SIZES.traced):
        words = list(argv)
        d, g = int(words[words.index("--head-dim") + 1]), int(words[words.index("--heads") + 1]) // int(
            words[words.index("--kv-heads") + 1])
        calls += [(d, g, tuple(int(x) for x in words[words.index(o) + 1].split("x")), b)
                  for o, b in (("--tile-size", False), ("--backward-tile-size", True)) if o in words]
    for d, g, tile, backward in calls:
        names = ("attend_block_v2_dkdv", "attend_block_v2_dq") if backward else ("attend_block_v2",)
        for kv_format in ("float16", "bfloat16"):
            config = fused_v2.kernel_config(tile, d, g, kv_format, backward=backward)
            for name in names:
                assert (config.head_dim, config.warps, config.bn, config.bf16, name) in built, (config, name)
    assert {(d, *fused.DEFAULT_TILE, half) for d in (64, 128) for half in (False, True)} <= v1


MPI_ANSWER = "MPICH Version: 4.3.2\n0\n('staged', 'auto: MPIX_Query_cuda_support() = 0')\n"


def test_the_cuda_probe_runs_on_a_gpu_only(tmp_path, monkeypatch):
    """The environment step compiles and runs its probe on a GPU, not on the
    fake GPU of --fake-gpu (whose CuPy compiles nothing) nor in a dry run."""
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT / "tests" / "support" / "gpu"))
    import gpu_check_kernels as kernels
    from queued_device import QueuedDevice
    gpu_check = load_gpu_check()
    probed = []
    monkeypatch.setattr(kernels, "cuda_probe", lambda ctx: (probed.append(ctx.fake) or True, "probed"))
    monkeypatch.setattr(kernels, "run", lambda ctx, cmd, limit: (0, MPI_ANSWER))       # the MPI library's answers
    with QueuedDevice().installed():
        for fake in (True, False):
            ctx = gpu_check.Context(dry=False, python=sys.executable, mpiexec="mpiexec", work=tmp_path, fake=fake,
                                    deadline=time.time() + 120)
            result = kernels.environment(ctx)
            assert result.ok, result.text
    assert probed == [False]


@pytest.mark.parametrize("missing", ["pytest", "hypothesis"])
def test_a_missing_test_package_fails_the_environment_naming_it(missing, tmp_path, monkeypatch):
    """The GPU tests need pytest and hypothesis: without either, the first
    step fails, naming it and saying to carry its wheels."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_kernels as kernels
    gpu_check = load_gpu_check()
    real = kernels.module_version
    monkeypatch.setattr(kernels, "module_version",
                        lambda name: f"missing (ModuleNotFoundError: {name})" if name == missing else real(name))
    monkeypatch.setattr(kernels, "run", lambda ctx, cmd, limit: (0, MPI_ANSWER))
    ctx = gpu_check.Context(dry=True, python=sys.executable, mpiexec="mpiexec", work=tmp_path,
                            deadline=time.time() + 120)
    result = kernels.environment(ctx)
    assert not result.ok and f"{missing} missing: carry their wheels" in result.text, result.text


def test_the_pth_lists_debian_dist_packages(tmp_path):
    """A Debian or Ubuntu system Python keeps its packages (CuPy, torch) in
    dist-packages: the check venv's .pth lists such a folder as it lists
    site-packages."""
    debian, target = tmp_path / "usr" / "lib" / "python3" / "dist-packages", tmp_path / "target"
    debian.mkdir(parents=True)
    target.mkdir()
    env = dict(os.environ, PYTHONPATH=str(debian))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "machine_pth.py"), str(target)], env=env, check=True,
                   timeout=60)
    line = (target / "machine-packages.pth").read_text()
    assert repr(str(debian)) in line and "site-packages" in line, line


def test_gpu_check_sh_help_names_its_own_options():
    """--help shows gpu_check.sh's own options (--wheels, --python, --venv),
    then those it passes on to scripts/gpu_check.py."""
    proc = subprocess.run(["bash", str(GPU_CHECK), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--wheels DIR", "--python PATH", "--venv DIR", "--dry-run", "--fake-gpu", "--only", "--minutes"):
        assert option in proc.stdout, option
