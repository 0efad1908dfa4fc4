"""Other projects' ring attention, held against this project's oracle (`make conformance`).

Adapters for ring-attention implementations of other projects that run on a
CPU, written on the kit's public PyTorch harness
(`reference.testing.harness.torch.TorchAdapter`: a persistent gloo world per
world size, so that hypothesis drives one example at a time and shrinks a
disagreement to its smallest case). The modules, in reading order:

    __main__.py                          the command line: python -m conformance --help
    run.py                               the runner: each (peer, dtype, mask set, pass) drawn, checked, stored
    results.py                           the results store, results/ (NumPy only)
    findings.py                          what explains each disagreement, read from the peers' code
    page.py                              CONFORMANCE.md and pages/ rendered from the store (NumPy only)
    ring_attention_pytorch_adapter.py    ring-attention-pytorch: contiguous and striped rings
    flash_attn_stand_in.py               flash-attn's block and varlen kernels on the CPU, for the next four
    ring_flash_attn_adapter.py           ring-flash-attn: ring, zigzag and stripe
    ring_flash_attn_varlen_adapter.py    ring-flash-attn: its varlen ring, zigzag and llama3 over packed documents
    weighted_merge.py                    ring-flash-attn's merge as a weighted sum (--explain-merge)
    torch_context_parallel_adapter.py    PyTorch's context-parallel ring core (torch 2.13), each balancer and rotation
    ringmaster_adapter.py                axolotl-ringmaster: all-gather and p2p rings, zigzag over packed documents
    ringmaster_usp_adapter.py            axolotl-ringmaster: its Ulysses and USP (Ulysses x ring)
    yunchang_adapter.py                  yunchang: its ring with the torch block kernel
    yunchang_usp_adapter.py              yunchang: its flash-attn rings, Ulysses and USP (Ulysses x ring)
    bpt_adapter.py                       the paper authors' JAX ring (bpt.py at 0c3ef0f), on the JAX harness,
                                         only when BPT names the file (make conformance BPT=path/to/bpt.py)
    example_ring_adapter.py              examples/torch_ring.py, this project's example ring, as a control
    preload.py                           the peers' libraries, imported once by the harness's forkserver

README.md says what the folder holds; CONFORMANCE.md and pages/ are what the
command writes. Nothing here is imported by the project or by `make test`.
"""

import os


def __getattr__(name):
    """`PEERS`, built on first use: importing the adapters imports torch, which
    rendering the stored results (conformance.results) does not need."""
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
