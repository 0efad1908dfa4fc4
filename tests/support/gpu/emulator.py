"""The fused kernels' CUDA source compiled for the CPU (emulate_cuda.cpp), built once and kept.

A build is a shared library per kernel version and set of compile-time sizes,
kept in a folder of the system's temporary directory under a name made from
everything that goes into it (the emulator, the kernel source, the options, the
compiler), so that a test session compiles only what changed since the last
one, and sessions running side by side share the builds. The emulator's standard
headers are precompiled once (parsing them was most of a build), and a variant
with a planted bug, which runs one small case, is built unoptimized: a third of
the time of an optimized build, on a fresh machine where every build is new.

    lib = emulator.build(fused_v2.SOURCE, fused_v2.Config(64, 2, 32, False).options(), version=2)
    step = emulator.EmulatedTensorCoreStep(lib)        # fused_v2's Step, launched on the CPU
    step.forward(acc, queries, block, mask=mask, tile_size=(16, 32))
"""

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


from gpu_impl import fused_v2

ROOT = Path(__file__).resolve().parents[3]
EMULATOR = Path(__file__).resolve().parent / "emulate_cuda.cpp"
GXX = shutil.which("g++")
CACHE = Path(tempfile.gettempdir()) / "striped-attention-emulator"
FLAGS = ("-std=c++20", "-fPIC", "-Wno-unknown-pragmas")
COMPILE_TIMEOUT_S = 300


class EmulatorError(RuntimeError):
    """A launch the emulator refused: a deadlock, a misaligned or out-of-bounds address..."""


def _version(tool):
    return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]


def _kept(name, parts, produce):
    """CACHE/name-<hash of parts>: made by produce(path) into a temporary folder
    and moved in whole, unless already there. One process makes it while the
    others that want it wait (pytest-xdist's workers each build the module's
    libraries: the second finds the first's)."""
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    CACHE.mkdir(parents=True, exist_ok=True)
    kept = CACHE / f"{name}-{key}"
    if kept.exists():
        return kept
    with open(CACHE / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)             # released when closed
        if not kept.exists():
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                part = Path(tmp) / "out"
                produce(part)
                os.replace(part, kept)
    return kept


def _flags(optimize):
    return [*FLAGS, "-O1" if optimize else "-O0"]


def standard_headers(optimize):
    """The header holding emulate_cuda.cpp's standard includes, precompiled
    beside it (header.gch) for these flags. Should g++ not take the .gch, it
    reads the header itself: slower, the same build."""
    includes = [line for line in EMULATOR.read_text().splitlines() if line.startswith("#include <")]
    flags = _flags(optimize)

    def compile_to(out):
        out.mkdir()
        (out / "std.h").write_text("\n".join(includes) + "\n")
        proc = subprocess.run([GXX, *flags, "-x", "c++-header", str(out / "std.h"), "-o", str(out / "std.h.gch")],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"the standard headers do not compile:\n{proc.stderr[-4000:]}")
    return _kept("headers", [*includes, *flags, _version(GXX)], compile_to) / "std.h"


def build_command(source, options, version, out, optimize=True):
    defines = [o for o in options if o.startswith("-D")]
    return [GXX, *_flags(optimize), "-shared", "-include", str(standard_headers(optimize)),
            f"-DKERNEL_VERSION={version}", *defines, f'-DKERNEL="{Path(source).resolve()}"',
            "-o", str(out), str(EMULATOR)]


def build(source, options, version, *, text=None):
    """Path of the library for this kernel `source` (or its `text`, for a
    variant with a planted bug: built unoptimized) and options; compiled if
    not already kept."""
    optimize = text is None
    text = Path(source).read_text() if text is None else text

    def compile_to(out):
        kernel = out.parent / Path(source).name
        kernel.write_text(text)
        proc = subprocess.run(build_command(kernel, options, version, out, optimize), capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"the emulator does not compile:\n{proc.stderr[-4000:]}")
    return _kept(f"v{version}.so", [EMULATOR.read_text(), text, *options, str(version), *_flags(optimize),
                                    _version(GXX)], compile_to)


def build_all(builds):
    """{key: library} for {key: (source, options, version)}, compiled two at a
    time (the machine's cores), or found from an earlier session; a build that
    fails raises with the compiler's message."""
    from concurrent.futures import ThreadPoolExecutor
    standard_headers(True)                  # once, before the builds that include it
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(builds, pool.map(lambda key: build(*builds[key]), builds)))


def build_v2(configs):
    """{Config: emulator library of fused_v2 with that config} (build_all)."""
    return build_all({c: (fused_v2.SOURCE, c.options(), 2) for c in configs})


def nvcc_cubin(source, options):
    """(cubin path, ptxas -v report) of the kernel compiled by nvcc for sm_90, kept like the builds."""
    from bench.gpu_kernel import nvcc_command, tool

    def compile_to(out):
        out.mkdir()
        proc = subprocess.run(nvcc_command(source, options, out / "kernel.cubin"), capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc fails:\n{proc.stderr[-4000:]}")
        (out / "ptxas.txt").write_text(proc.stderr)
    kept = _kept("nvcc", [Path(source).read_text(), *options, _version(tool("nvcc"))], compile_to)
    return kept / "kernel.cubin", (kept / "ptxas.txt").read_text()


def load(lib):
    """The library, its functions typed."""
    cdll = ctypes.CDLL(str(lib))
    cdll.emu_last_error.restype = ctypes.c_char_p
    cdll.emu_bank_conflicts.restype = ctypes.c_longlong
    cdll.emu_warp_ops.restype = ctypes.c_longlong
    cdll.emu_pack_16x2.restype = ctypes.c_uint
    cdll.emu_pack_16x2.argtypes = [ctypes.c_float, ctypes.c_float]
    cdll.emu_from_16.restype = ctypes.c_float
    cdll.emu_from_16.argtypes = [ctypes.c_ushort]
    return cdll


def _pointer(x):
    assert x.flags.c_contiguous, "the kernel reads C-contiguous arrays"
    return ctypes.c_void_p(x.ctypes.data)


class EmulatedTensorCoreStep(fused_v2.TensorCoreStep):
    """fused_v2's Step with its launch on the CPU: the same checks, plan and
    arguments, NumPy arrays (K, V float16 or ml_dtypes bfloat16).
    `libraries`: {Config: library} (`build`), one per tile the calls use."""
    array_modules = ("numpy",)

    def __init__(self, libraries, kv_format=None):
        super().__init__(kv_format)
        self.libraries = {config: load(lib) for config, lib in libraries.items()}

    def launch(self, acc, queries, block, plan):
        lib = self.libraries.get(plan.config)
        if lib is None:
            raise KeyError(f"no emulator build for {plan.config}")
        B, Hkv, c, G, D = queries.q.shape
        args = [_pointer(x) for x in (queries.q, block.k, block.v, plan.k_pos, plan.q_lo, plan.q_hi, plan.q_doc,
                                      plan.k_doc, plan.kinds, acc.o, acc.m, acc.l)]
        scalars = plan.scalars(c, block.k.shape[2], G)
        args += [ctypes.c_int(int(x)) for x in scalars[:5]] + [ctypes.c_float(float(x)) for x in scalars[5:]]
        rc = lib.launch_attend_block_v2(ctypes.c_int(plan.grid[0]), ctypes.c_int(plan.grid[1]),
                                        ctypes.c_int(plan.config.shared_bytes), *args)
        if rc != 0:
            raise EmulatorError(lib.emu_last_error().decode())

    def launch_backward(self, grads, queries, rows, block, plan):
        """fused_v2's two backward launches, as `fused_v2.launch_backward_kernels` makes them."""
        lib = self.libraries.get(plan.config)
        if lib is None:
            raise KeyError(f"no emulator build for {plan.config}")
        B, Hkv, c, G, D = queries.q.shape
        inputs = [_pointer(x) for x in (queries.q, rows.do, rows.lse, rows.delta, block.k, block.v, plan.k_pos,
                                        plan.q_lo, plan.q_hi, plan.q_doc, plan.k_doc, plan.kinds)]
        scalars = plan.scalars(c, block.k.shape[2], G)
        scalars = [ctypes.c_int(int(x)) for x in scalars[:5]] + [ctypes.c_float(float(x)) for x in scalars[5:]]
        shared = ctypes.c_int(plan.config.backward_shared_bytes)
        for rc in (lib.launch_attend_block_v2_dkdv(ctypes.c_int(plan.kinds.shape[1]), ctypes.c_int(plan.grid[1]),
                                                   shared, *inputs, _pointer(grads.dk), _pointer(grads.dv),
                                                   *scalars),
                   lib.launch_attend_block_v2_dq(ctypes.c_int(plan.grid[0]), ctypes.c_int(plan.grid[1]), shared,
                                                 *inputs, _pointer(grads.dq), *scalars)):
            if rc != 0:
                raise EmulatorError(lib.emu_last_error().decode())

