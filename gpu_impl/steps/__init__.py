"""The GPU's block steps, the workshop beside gpu_impl's mainline: numbered CUDA kernels, one contract.

Each version keeps `reference.step`'s contract, registers itself with
`reference.steps` when imported (so ``step="fused"`` and ``step="fused_v2"``
name them, and "auto" tries version 2 first on CuPy), and is checked against
the readable step before it is timed: on the CPU by running its CUDA source
under tests/support/gpu/emulate_cuda.cpp, on a GPU by `make gpu-check`. Each
kernel's source opens with what its version changes, the command that checks
it and what it bought (expected: no GPU has run them yet).

Modules, in reading order:

- `fused`: version 1, ``step="fused"``: the forward as one launch of
  kernels/attend_block_v1.cu, a thread per query row, float32;
- `fused_v2`: version 2, ``step="fused_v2"``: forward and backward on the tensor
  cores, FlashAttention-2's dataflow, every mask, float16 and bfloat16:
  kernels/attend_block_v2.cuh (what its kernels share), attend_block_v2.cu (the
  forward), attend_block_v2_dkdv.cu and attend_block_v2_dq.cu (the backward).

    gpu_impl.ring_attention(q, k, v, comm=comm, step="fused_v2")
    reference.steps.get("fused_v2").forward(acc, queries, block, mask=mask, tile_size=None)
"""

from .fused import FusedStep            # importing a version registers it with reference.steps
from .fused_v2 import TensorCoreStep

__all__ = ["FusedStep", "TensorCoreStep"]
