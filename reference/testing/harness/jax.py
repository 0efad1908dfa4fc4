"""The JAX harness: a ring written with shard_map and ppermute, held against the oracle.

JAX runs N devices in one process: on a CPU, XLA makes N host devices when
XLA_FLAGS has --xla_force_host_platform_device_count=N before its CPU backend
starts. The user writes only what one device computes from its shard, in
jax.numpy; the harness lays every rank's shard on its device, runs that
function under `jax.shard_map` over a one-axis mesh named "ring", takes the
gradients of sum(out * dout) with `jax.vjp` (so a ring's backward is its
autodiff, or its `custom_vjp`), and hands the kit every rank's results:

    from reference.testing.harness.jax import JaxAdapter

    class Mine(JaxAdapter):
        name = "my jax ring"

        def compute(self, case, shard):     # shard.q (B, c, Hq, D), shard.k, shard.v, shard.positions (c,)
            out, lse = my_ring(shard.q, shard.k, shard.v, axis=shard.axis, n=shard.world_size, ...)
            return dict(out=out, lse=lse)   # this device's out (B, c, Hq, D), lse (B, Hq, c)

    python -m reference.testing check my_module:Mine --world-sizes 2,3,4

Inside `compute`, `jax.lax.ppermute(x, shard.axis, perm)` passes blocks round
the ring and `jax.lax.axis_index(shard.axis)` is the rank. Float64 cases need
64-bit JAX: the harness turns `jax_enable_x64` on. Importing this module sets XLA_FLAGS
(to `DEVICES` devices, unless it names a count already) but not jax; a JAX
whose CPU backend started with fewer devices than a case needs is an error
that says what to do. Example: examples/jax_ring.py.
"""

import os
import re
from dataclasses import dataclass, replace

import numpy as np

from ..adapter import Adapter
from ..cases import INPUT_KINDS, MAX_DEVICES

DEVICES = MAX_DEVICES
AXIS = "ring"
PROGRAMS = 64               # compiled programs an adapter keeps (the oldest goes)
FLAG = "--xla_force_host_platform_device_count"


def request_devices(n=DEVICES):
    """Ask XLA for `n` CPU devices (XLA_FLAGS), unless the flag is set already;
    it takes effect only if JAX's CPU backend has not started yet."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={n}".strip()


request_devices()           # before the user's module touches jax, if it can be


def cpu_devices(n):
    """The first `n` of JAX's CPU devices, 64-bit floats on; RuntimeError saying
    how to get more when JAX's CPU backend started with fewer."""
    import jax
    jax.config.update("jax_enable_x64", True)
    devices = jax.devices("cpu")
    if len(devices) < n:
        found = re.search(FLAG + r"=(\d+)", os.environ.get("XLA_FLAGS", ""))
        raise RuntimeError(
            f"this case needs {n} JAX CPU devices, and JAX has {len(devices)}: its CPU backend started "
            f"before XLA_FLAGS asked for {n}" + (f" (it asks for {found.group(1)})" if found else "") +
            f". Set XLA_FLAGS={FLAG}={max(n, DEVICES)} in the environment, or import "
            f"reference.testing.harness.jax before the first JAX call")
    return devices[:n]


@dataclass
class DeviceShard:
    """What `compute` gets on one device (traced jax arrays, local token order):
    q (B, c, Hq, D), k, v (B, c, Hkv, D), positions (c,) int the global
    positions it holds; axis the mesh axis's name; world_size N."""
    q: object
    k: object
    v: object
    positions: object
    axis: str
    world_size: int


class JaxAdapter(Adapter):
    """A kit `Adapter` whose ranks are JAX devices. Subclasses set what the ring
    takes (`layouts`, `dtypes`, `masks`, `positions`, ...: see `Adapter`) and
    write `compute(case, shard)`: this device's {"out", "lse"} (out in the
    input dtype, lse float32, float64 for float64 inputs). The harness adds
    dq, dk, dv by `jax.vjp` of the sharded function (dout the cotangent of out,
    none for lse).

    Compiling is most of a case's time (0.5 to 4 s on a CPU, the run a few
    ms), so the harness keeps each compiled program (`program`) for the cases
    that differ from it only in their inputs, and the command line draws each
    world size's shapes from `shape_pool` (the kit's `cases(shapes=...)`):
    the masks, dtypes, input kinds and seeds still vary case by case.
    `compute` sees the case less its inputs (`program_key`)."""
    name = "jax ring"
    shape_pool = 4
    flushes_subnormals = True       # XLA's CPU runtime flushes float32 subnormals to zero (oracle.flushed)

    def compute(self, case, shard):
        raise NotImplementedError

    def run(self, case, shards):
        import jax
        from jax.sharding import Mesh, PartitionSpec as P
        n = case.n_devices
        q, k, v, dout = (np.concatenate(x, axis=1) for x in (shards.q, shards.k, shards.v, shards.dout))
        pos = np.asarray(shards.positions).reshape(-1)             # (N*c,): rank r's c positions, then r+1's
        full = dict(zip(("out", "lse", "dq", "dk", "dv"), self.program(case)(q, k, v, dout, pos)))
        return [{name: np.split(np.asarray(x), n, axis=2 if name == "lse" else 1)[r] for name, x in full.items()}
                for r in range(n)]

    def program(self, case):
        """The jitted forward (and backward) of `case`, made once per `program_key`:
        the cases that share it run the same compiled program on their own inputs."""
        programs = self.__dict__.setdefault("_programs", {})
        key = (self.backward, program_key(case))
        if key not in programs:
            if len(programs) >= PROGRAMS:
                programs.pop(next(iter(programs)))                  # the oldest
            programs[key] = self._jit(key[1])
        return programs[key]

    def _jit(self, case):
        import jax
        from jax.sharding import Mesh, PartitionSpec as P
        n = case.n_devices
        mesh = Mesh(np.array(cpu_devices(n)), (AXIS,))
        tokens, lse_spec = P(None, AXIS), P(None, None, AXIS)      # axis 1 of (B, N*c, H, D) is cut in N

        compute, backward = self.compute, self.backward

        def device(q, k, v, pos):                                  # one device's shard
            got = compute(case, DeviceShard(q, k, v, pos, AXIS, n))
            return got["out"], got["lse"]

        # check_vma=False: a user's ring need not tell JAX which of its values differ between devices
        ring = jax.shard_map(device, mesh=mesh, in_specs=(tokens, tokens, tokens, P(AXIS)),
                             out_specs=(tokens, lse_spec), check_vma=False)

        @jax.jit
        def forward_backward(q, k, v, dout, pos):
            (out, lse), pullback = jax.vjp(lambda q, k, v: ring(q, k, v, pos), q, k, v)
            if not backward:
                return out, lse
            return out, lse, *pullback((dout, jax.numpy.zeros_like(lse)))

        return forward_backward


def program_key(case):
    """What a compiled program may depend on: the case less its inputs (kind,
    seed, poison), which reach the program only as arrays. `compute` is given
    this case, so it cannot bake an input into the program."""
    return replace(case, kind=INPUT_KINDS[0], seed=0, poison=())
