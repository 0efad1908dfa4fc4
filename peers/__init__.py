"""Other projects' ring attention, held against this project's oracle.

Adapters (`reference.testing.Adapter`) for ring-attention implementations of
other projects that run on a CPU, each in its own persistent group of
torch.distributed processes (gloo) per world size, so that hypothesis drives
one example at a time and shrinks a disagreement to its smallest case:

    peers/ring_attention_pytorch_adapter.py   ring-attention-pytorch: contiguous and striped rings
    peers/ring_flash_attn_adapter.py          ring-flash-attn: ring, zigzag and stripe, with
                                              peers/flash_attn_stand_in.py for flash-attn's kernels
    peers/group.py                            the process groups
    peers/conformance.py                      the runner; writes CONFORMANCE.md

    make conformance                          # installs the `peers` extra, runs, writes CONFORMANCE.md
    python -m peers.conformance --help

Nothing here is imported by the project or by `make test`.
"""

from .ring_attention_pytorch_adapter import RingAttentionPytorch
from .ring_flash_attn_adapter import RingFlashAttn

PEERS = {peer.key: peer for peer in (
    RingAttentionPytorch.contiguous(), RingAttentionPytorch.striped(),
    RingAttentionPytorch.contiguous(whole_buckets=True), RingAttentionPytorch.striped(whole_buckets=True),
    RingFlashAttn.ring(), RingFlashAttn.zigzag(), RingFlashAttn.stripe())}
