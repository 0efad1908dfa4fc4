"""The JAX harness (reference.testing.harness.jax) and the JAX ring of examples/jax_ring.py.

The example ring, run under shard_map on N CPU devices with its gradients by
jax.vjp, agrees with the oracle on every layout, GQA, float64 (64-bit JAX)
and bfloat16, windows, packed documents and padding; the same ring with K and V sent round the ring in bfloat16
(half the bytes) fails: autodiff sends dK and dV back in bfloat16 too, and
rounds their partial sums in every round. Too few devices is an error that
says what to do. Skipped where JAX is not installed (`make test` has no JAX;
the `peers` extra has):

    conformance/.venv/bin/python -m pytest tests/kit/test_jax_harness.py -q      # the venv make conformance makes
"""

import os
import runpy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from reference.testing import BFLOAT16, Case, check_ring_attention
from reference.testing.harness.jax import FLAG

jax = pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = runpy.run_path(str(ROOT / "examples" / "jax_ring.py"))
JaxRing = EXAMPLE["JaxRing"]


class KVInBfloat16(JaxRing):
    """The example with K and V sent in bfloat16, whatever the input dtype."""
    name = "jax ring, K and V sent in bfloat16"

    def compute(self, case, shard):
        out, lse = EXAMPLE["ring_attention"](shard.q, shard.k, shard.v, shard.positions, axis=shard.axis,
                                             n=shard.world_size, visible=EXAMPLE["visible_keys"](case),
                                             scale=case.scale_value, kv_dtype=BFLOAT16)
        return dict(out=out, lse=lse)


# a few problems, each compiled once: N = 1 to 4, every layout, GQA, a negative scale, every
# dtype, a window, documents (cu_seqlens, segment ids in no order), padding
AGREES = [
    Case("contiguous", 1, 1, 3, 1, 1, 2, None, True, None, np.float32, "gaussian", 0),
    Case("striped", 4, 1, 8, 2, 1, 4, None, True, None, BFLOAT16, "gaussian", 1, window=3),
    Case("zigzag", 3, 2, 12, 3, 3, 5, None, False, -0.7, np.float64, "large_logits", 2, cu_seqlens=(0, 5, 12)),
    Case("striped", 2, 1, 6, 4, 2, 3, None, True, 0.3, np.float16, "constant_keys", 3),
    Case("zigzag", 2, 1, 7, 2, 1, 3, None, False, None, np.float32, "gaussian", 4, window=2,
         segment_ids=(1, 0, 1, 1, 2, 0, 2)),
]


@pytest.mark.parametrize("case", AGREES, ids=lambda c: "-".join([c.layout, f"N{c.n_devices}", np.dtype(c.dtype).name,
                                                                  *c.masks[1:]]))
def test_the_example_jax_ring_agrees(case):
    check_ring_attention(JaxRing(), case)


def test_a_forward_only_adapter_returns_out_and_lse():
    ring = type("ForwardOnly", (JaxRing,), dict(backward=False))()
    results = check_ring_attention(ring, AGREES[0])
    assert set(results[0]) == {"out", "lse"}


def test_kv_sent_in_bfloat16_rounds_the_gradients_and_is_caught():
    case = Case("contiguous", 4, 2, 8, 2, 1, 8, None, True, None, BFLOAT16, "constant", 1)
    check_ring_attention(JaxRing(), case)
    with pytest.raises(AssertionError, match=r"dv: \d+ of 32 elements out of tolerance"):
        check_ring_attention(KVInBfloat16(), case)


class CountsTraces(JaxRing):
    """The example, counting how often JAX traces its compute (once per compiled program)."""
    traces = 0

    def compute(self, case, shard):
        type(self).traces += 1
        return super().compute(case, shard)


def test_a_compiled_program_serves_every_case_that_differs_only_in_its_inputs():
    ring, shape = CountsTraces(), AGREES[1]
    for i, kind in enumerate(("gaussian", "large_logits", "constant", "exact")):
        check_ring_attention(ring, replace(shape, kind=kind, seed=10 + i))
    assert ring.traces == 1
    check_ring_attention(ring, replace(shape, causal=False))            # the mask is the program's: compiled anew
    check_ring_attention(ring, replace(shape, window=2))
    assert ring.traces == 3


def test_the_command_line_compiles_once_per_shape_in_the_pool():
    """12 cases from a pool of 2 striped shapes: at most 2 shapes x causal / full programs."""
    from reference.testing.check import check_adapter, make_plan
    ring = CountsTraces()
    CountsTraces.traces = 0
    plan = make_plan(ring, world_sizes=(2,), layouts=("striped",), dtypes=("float32",), masks=("causal", "full"),
                     examples=12, shapes=2)
    verdict = check_adapter(ring, plan)
    assert verdict.agrees and verdict.examples == {2: 12}, verdict
    assert CountsTraces.traces <= 4, CountsTraces.traces


# scores in the hundreds: probabilities below float32's smallest normal, times |q| of about 50 in dk
FLUSHED = Case("contiguous", 2, 2, 28, 2, 2, 7, 4, False, None, np.float32, "large_logits", 1)


def test_xla_flushes_subnormals_and_the_harness_says_so():
    """XLA on a CPU flushes float32 subnormals to zero: exp(-88) is 0, not 6e-39, and a
    dk of -5.7e-38 comes back 0. The harness declares it, and the line adds what it drops."""
    assert float(jax.jit(jax.numpy.exp)(np.float32(-88.0))) == 0.0 < float(np.exp(np.float32(-88.0)))
    check_ring_attention(JaxRing(), FLUSHED)
    unsaid = type("Unsaid", (JaxRing,), dict(flushes_subnormals=False))()
    with pytest.raises(AssertionError, match=r"dk: \d+ of 392 elements out of tolerance.*got 0\.0, expected"):
        check_ring_attention(unsaid, FLUSHED)


def test_too_few_devices_says_what_to_do():
    code = ("import numpy as np, runpy\n"
            "from reference.testing import Case, check_ring_attention\n"
            "ring = runpy.run_path('examples/jax_ring.py')['JaxRing']()\n"
            "check_ring_attention(ring, Case('striped', 4, 1, 4, 1, 1, 1, None, True, None, np.float32, 'gaussian', 0))\n")
    env = dict(os.environ, XLA_FLAGS=f"{FLAG}=2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert (f"this case needs 4 JAX CPU devices, and JAX has 2: its CPU backend started before XLA_FLAGS asked "
            f"for 4 (it asks for 2). Set XLA_FLAGS={FLAG}=8") in proc.stderr, proc.stderr


def test_the_command_line_checks_the_example():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "reference.testing", "check", "examples/jax_ring.py:JaxRing",
                           "--world-sizes", "2", "--examples", "3", "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("examples/jax_ring.py agrees (3 examples per world size, N = 2;"), proc.stdout
