"""The fused kernels' CUDA source compiled for the CPU (emulate_cuda.cpp), built once, kept, launched with guards.

A build is a shared library per kernel version and set of compile-time sizes,
kept in a folder of the system's temporary directory under a name made from
everything that goes into it (the emulator, the kernel source, the options, the
compiler), so that a test session compiles only what changed since the last
one, and sessions running side by side share the builds. The emulator's standard
headers are precompiled once (parsing them was most of a build), and a variant
with a planted bug, which runs one small case, is built unoptimized: a third of
the time of an optimized build, on a fresh machine where every build is new.

Every launch hands the kernel copies of its arrays with a guard region either
side (`Guarded`), filled with 0xff bytes: a read past an array's end reads NaN
(or -1), and a write there, or into an input, fails the launch with an
`EmulatorError` naming the array, instead of corrupting the heap.

    lib = emulator.build(fused_v2.kernel_source(), fused_v2.Config(64, 2, 32, False).options(), version=2)
    step = emulator.EmulatedTensorCoreStep({config: lib})    # fused_v2's Step, launched on the CPU
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


import numpy as np

from gpu_impl.steps import fused, fused_v2

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


def build_command(kernel, options, version, out, optimize=True):
    defines = [o for o in options if o.startswith("-D")]
    return [GXX, *_flags(optimize), "-shared", "-include", str(standard_headers(optimize)),
            f"-DKERNEL_VERSION={version}", *defines, f'-DKERNEL="{Path(kernel).resolve()}"',
            "-o", str(out), str(EMULATOR)]


def build(text, options, version, *, optimize=True):
    """Path of the library for the kernel source `text` (the whole translation
    unit: `fused.kernel_source()`, `fused_v2.kernel_source()`, or a variant
    with a planted bug, built with ``optimize=False``) and options; compiled
    if not already kept."""
    def compile_to(out):
        kernel = out.parent / "kernel.cu"
        kernel.write_text(text)
        proc = subprocess.run(build_command(kernel, options, version, out, optimize), capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"the emulator does not compile:\n{proc.stderr[-4000:]}")
    return _kept(f"v{version}.so", [EMULATOR.read_text(), text, *options, str(version), *_flags(optimize),
                                    _version(GXX)], compile_to)


def build_all(builds):
    """{key: library} for {key: (text, options, version)}, compiled two at a
    time (the machine's cores), or found from an earlier session; a build that
    fails raises with the compiler's message."""
    from concurrent.futures import ThreadPoolExecutor
    standard_headers(True)                  # once, before the builds that include it
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(builds, pool.map(lambda key: build(*builds[key]), builds)))


def build_v2(configs):
    """{Config: emulator library of fused_v2 with that config} (build_all)."""
    text = fused_v2.kernel_source()
    return build_all({c: (text, c.options(), 2) for c in configs})


def nvcc_cubin(text, options):
    """(cubin path, ptxas -v report) of the kernel source `text` compiled by nvcc for sm_90, kept like the builds."""
    from bench.gpu_kernel import nvcc_command, tool

    def compile_to(out):
        out.mkdir()
        (out / "kernel.cu").write_text(text)
        proc = subprocess.run(nvcc_command(out / "kernel.cu", options, out / "kernel.cubin"), capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc fails:\n{proc.stderr[-4000:]}")
        (out / "ptxas.txt").write_text(proc.stderr)
    kept = _kept("nvcc", [text, *options, _version(tool("nvcc"))], compile_to)
    return kept / "kernel.cubin", (kept / "ptxas.txt").read_text()


def sass(cubin):
    """`cuobjdump --dump-sass` of `cubin` (with nvdisasm), kept like the builds: each
    session reads the same few megabytes of text instead of disassembling again.
    None where either tool is missing."""
    from bench.gpu_kernel import tool
    dump, disassembler = tool("cuobjdump"), tool("nvdisasm")
    if dump is None or disassembler is None:
        return None

    def disassemble_to(out):
        out.mkdir()
        proc = subprocess.run([dump, "--dump-sass", str(cubin)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S, env=dict(os.environ, NVDISASM_PATH=disassembler))
        if proc.returncode != 0:
            raise RuntimeError(f"cuobjdump fails:\n{proc.stderr[-4000:]}")
        (out / "kernel.sass").write_text(proc.stdout)
    cubin_hash = hashlib.sha256(Path(cubin).read_bytes()).hexdigest()
    kept = _kept("sass", [cubin_hash, _version(dump), _version(disassembler)], disassemble_to)
    return (kept / "kernel.sass").read_text()


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


GUARD_BYTES = 4096       # either side of every array a launch gets
# The guards' bytes, repeated: a signalling NaN as float32 (0x7fa5a5a5), which
# arithmetic turns quiet, so that a read-modify-write (dK += ...) changes it
# as a store does; a NaN in every other float16 or bfloat16 slot.
POISON = np.frombuffer(b"\xa5\xa5\xa5\x7f", np.uint8)


class Guarded:
    """The arrays of one launch, each copied into a buffer with a guard region
    of POISON either side (its address kept the same modulo 64, so a
    misaligned view stays misaligned), handed to the kernel by `pointer`.
    `finish` checks every guard and every input, then copies the outputs back:
    a kernel that wrote past an array's end (dK one key past the block), before
    its start, or into an input raises an EmulatorError naming it."""

    def __init__(self):
        self.kept = []          # (name, array, buffer, its poison, is output)

    def pointer(self, name, x, *, output=False):
        assert x.flags.c_contiguous, f"the kernel reads C-contiguous arrays, {name} is not"
        raw = np.empty(x.nbytes + 2 * GUARD_BYTES + 128, np.uint8)
        start = (-raw.ctypes.data) % 64 + GUARD_BYTES + x.ctypes.data % 64
        buffer = raw[start - GUARD_BYTES:start + x.nbytes + GUARD_BYTES]
        poison = np.resize(POISON, buffer.size)
        buffer[:] = poison
        buffer[GUARD_BYTES:GUARD_BYTES + x.nbytes] = x.reshape(-1).view(np.uint8)
        self.kept.append((name, x, buffer, poison, output))
        return ctypes.c_void_p(buffer[GUARD_BYTES:].ctypes.data)

    def finish(self, kernel):
        """After the launch of `kernel`: the guards and inputs unchanged, the outputs copied back."""
        for name, x, buffer, poison, output in self.kept:
            end = GUARD_BYTES + x.nbytes
            for where, written in (("before its start", GUARD_BYTES - 1 - np.flatnonzero(
                                        buffer[:GUARD_BYTES] != poison[:GUARD_BYTES])[::-1]),
                                   ("past its end", np.flatnonzero(buffer[end:] != poison[end:]))):
                if written.size:
                    raise EmulatorError(f"{kernel} wrote {name} {where}: {written.size} bytes changed, the "
                                        f"nearest in element {written[0] // x.dtype.itemsize + 1} "
                                        f"{where.split()[0]} it ({name} {x.dtype} {x.shape})")
            inside = buffer[GUARD_BYTES:end]
            if output:
                x.reshape(-1).view(np.uint8)[:] = inside
            elif not np.array_equal(inside, x.reshape(-1).view(np.uint8)):
                raise EmulatorError(f"{kernel} wrote into its input {name} {x.dtype} {x.shape}")


def _check(lib, rc, guarded, kernel):
    if rc != 0:
        raise EmulatorError(f"{kernel}: {lib.emu_last_error().decode()}")
    guarded.finish(kernel)


def _scalars(plan, c, ck, G):
    scalars = plan.scalars(c, ck, G)
    return [ctypes.c_int(int(x)) for x in scalars[:5]] + [ctypes.c_float(float(x)) for x in scalars[5:]]


def _plan_arrays(guarded, plan):
    return [guarded.pointer(name, getattr(plan, name)) for name in ("k_pos", "q_lo", "q_hi", "q_doc", "k_doc", "kinds")]


class EmulatedTensorCoreStep(fused_v2.TensorCoreStep):
    """fused_v2's Step with its launch on the CPU: the same checks, plan and
    arguments, NumPy arrays (K, V float16 or ml_dtypes bfloat16), every array
    guarded (`Guarded`). `libraries`: {Config: library} (`build`), one per
    tile the calls use."""
    array_modules = ("numpy",)

    def __init__(self, libraries, kv_format=None):
        super().__init__(kv_format)
        self.libraries = {config: load(lib) for config, lib in libraries.items()}

    def _library(self, config):
        lib = self.libraries.get(config)
        if lib is None:
            raise KeyError(f"no emulator build for {config}")
        return lib

    def launch(self, acc, queries, block, plan):
        lib, guarded = self._library(plan.config), Guarded()
        B, Hkv, c, G, D = queries.q.shape
        args = [guarded.pointer(name, x) for name, x in (("q", queries.q), ("k", block.k), ("v", block.v))]
        args += _plan_arrays(guarded, plan)
        args += [guarded.pointer(name, x, output=True) for name, x in (("o", acc.o), ("m", acc.m), ("l", acc.l))]
        rc = lib.launch_attend_block_v2(ctypes.c_int(plan.grid[0]), ctypes.c_int(plan.grid[1]),
                                        ctypes.c_int(plan.config.shared_bytes), *args,
                                        *_scalars(plan, c, block.k.shape[2], G))
        _check(lib, rc, guarded, "attend_block_v2")

    def launch_backward(self, grads, queries, rows, block, plan):
        """fused_v2's two backward launches, as `fused_v2.launch_backward_kernels` makes them."""
        lib = self._library(plan.config)
        B, Hkv, c, G, D = queries.q.shape
        shared = ctypes.c_int(plan.config.backward_shared_bytes)
        scalars = _scalars(plan, c, block.k.shape[2], G)
        for kernel, grid, outputs in (("attend_block_v2_dkdv", (plan.kinds.shape[1], plan.grid[1]),
                                       (("dk", grads.dk), ("dv", grads.dv))),
                                      ("attend_block_v2_dq", plan.grid, (("dq", grads.dq),))):
            guarded = Guarded()
            inputs = [guarded.pointer(name, x) for name, x in (("q", queries.q), ("do", rows.do), ("lse", rows.lse),
                                                                ("delta", rows.delta), ("k", block.k), ("v", block.v))]
            inputs += _plan_arrays(guarded, plan)
            outs = [guarded.pointer(name, x, output=True) for name, x in outputs]
            rc = getattr(lib, f"launch_{kernel}")(*(ctypes.c_int(i) for i in grid), shared, *inputs, *outs, *scalars)
            _check(lib, rc, guarded, kernel)


def launch_v1(lib, acc, queries, block, *, causal, tile):
    """`fused.launch_kernel` on the CPU (version 1's library, `load`ed): the
    same checks, grid and arguments, every array guarded."""
    fused.check_launch(acc, queries, block)
    guarded = Guarded()
    B, Hkv, c, G, D = queries.q.shape
    args = [guarded.pointer(name, np.ascontiguousarray(x)) for name, x in (
        ("q", queries.q), ("k", block.k), ("v", block.v), ("q_pos", np.asarray(queries.pos, np.int64)),
        ("k_pos", np.asarray(block.pos, np.int64)))]
    args += [guarded.pointer(name, x, output=True) for name, x in (("o", acc.o), ("m", acc.m), ("l", acc.l))]
    grid = ((c + tile[0] - 1) // tile[0], G, B * Hkv)
    rc = lib.launch_attend_block_v1(*(ctypes.c_int(i) for i in grid), *args,
                                    *(ctypes.c_int(i) for i in (c, block.k.shape[2], G, int(causal))))
    _check(lib, rc, guarded, "attend_block_v1")
