"""Other projects' ring attention, held against this project's oracle.

Adapters for ring-attention implementations of other projects that run on a
CPU, written on the kit's public PyTorch harness
(`reference.testing.harness.torch.TorchAdapter`: a persistent gloo world per
world size, so that hypothesis drives one example at a time and shrinks a
disagreement to its smallest case); each says what one rank computes:

    peers/ring_attention_pytorch_adapter.py   ring-attention-pytorch: contiguous and striped rings
    peers/ring_flash_attn_adapter.py          ring-flash-attn: ring, zigzag and stripe, with
                                              peers/flash_attn_stand_in.py for flash-attn's kernels
    peers/ring_flash_attn_varlen_adapter.py   ring-flash-attn: its varlen ring, zigzag and llama3
                                              functions over packed documents
    peers/torch_context_parallel_adapter.py   PyTorch's context-parallel ring core (torch 2.13), with and
                                              without its head-tail balancer, each rotation
    peers/ringmaster_adapter.py               axolotl-ringmaster: all-gather and p2p rings, zigzag over
                                              packed documents
    peers/ringmaster_usp_adapter.py           axolotl-ringmaster: its Ulysses and USP (Ulysses x ring)
    peers/yunchang_adapter.py                 yunchang: its ring with the torch block kernel
    peers/yunchang_usp_adapter.py             yunchang: its flash-attn rings, Ulysses and USP (Ulysses x ring)
    peers/bpt_adapter.py                      the paper authors' JAX ring (bpt.py, exists-forall/striped_attention
                                              at 0c3ef0f), striped and normal; on the JAX harness, only when
                                              BPT names the file (`make conformance BPT=path/to/bpt.py`)
    peers/example_ring_adapter.py             examples/torch_ring.py, this project's example ring, run
                                              beside them as a control
    peers/conformance.py                      the runner: stores each run in peers/results/
    peers/findings.py                         what explains each disagreement, read from the peers' code
    peers/results.py                          the results store
    peers/page.py                             CONFORMANCE.md and docs/conformance/ rendered from it (NumPy only)

    make conformance                          # installs the `peers` extra, runs, writes CONFORMANCE.md
    python -m peers.conformance --help

Nothing here is imported by the project or by `make test`.
"""

import os


def __getattr__(name):
    """`PEERS`, built on first use: importing the adapters imports torch, which
    rendering the stored results (peers.results) does not need."""
    if name == "PEERS":
        global PEERS
        PEERS = _peers()
        return PEERS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _peers():
    """Every adapter, by key (the first peer to start a world names the modules
    its forkserver preloads: a peer's)."""
    from .example_ring_adapter import ExampleRing
    from .ring_attention_pytorch_adapter import RingAttentionPytorch
    from .ring_flash_attn_adapter import RingFlashAttn
    from .ring_flash_attn_varlen_adapter import RingFlashAttnVarlen
    from .ringmaster_adapter import Ringmaster
    from .ringmaster_usp_adapter import RingmasterUSP
    from .torch_context_parallel_adapter import TorchContextParallel
    from .yunchang_adapter import Yunchang
    from .yunchang_usp_adapter import YunchangRing, YunchangUlysses, YunchangUSP, YunchangVarlen

    peers = {peer.key: peer for peer in (
        RingAttentionPytorch.contiguous(), RingAttentionPytorch.striped(),
        RingAttentionPytorch.contiguous(whole_buckets=True), RingAttentionPytorch.striped(whole_buckets=True),
        RingFlashAttn.ring(), RingFlashAttn.zigzag(), RingFlashAttn.stripe(),
        RingFlashAttnVarlen("ring"), RingFlashAttnVarlen("zigzag"), RingFlashAttnVarlen("llama3"),
        *(TorchContextParallel(balance, rotate) for balance in (True, False) for rotate in ("ALL_GATHER", "ALL_TO_ALL")),
        TorchContextParallel(False, "ALL_GATHER", negative_scales=True),
        Ringmaster("allgather"), Ringmaster("p2p"), Ringmaster("zigzag-packed"),
        *(RingmasterUSP(entry) for entry in ("ulysses", "usp-allgather", "usp-p2p")), Yunchang(),
        *(YunchangRing(ring) for ring in ("basic", "zigzag", "strip")), YunchangUlysses(),
        *(YunchangUSP(ring) for ring in ("basic", "zigzag", "strip")),
        *(YunchangUSP(ring, ulysses_low=False) for ring in ("basic", "zigzag", "strip")),
        YunchangUlysses(torch_kernel=True), YunchangUSP("basic", torch_math=True),
        YunchangUSP("basic", pack_qkv=True), YunchangVarlen("ring"), YunchangVarlen("zigzag"),
        ExampleRing())}
    if os.environ.get("BPT"):            # bpt.py is not on the package index: the user names the file
        from .bpt_adapter import BptContiguous, BptContiguousChunked, BptStriped, BptStripedAsIs, BptStripedChunked
        peers.update({peer.key: peer for peer in (BptStriped(), BptContiguous(), BptStripedChunked(),
                                                  BptContiguousChunked(), BptStripedAsIs())})
    return peers
