"""ring-flash-attn (pip `ring-flash-attn`): its three varlen functions, over
packed documents drawn by the kit (`cu_seqlens`), with
`conformance.flash_attn_stand_in` computing flash-attn's varlen kernels on the CPU:

    ring_flash_attn_varlen_func          ring_flash_attn_varlen.py: every document cut in N
                                         contiguous pieces, rank r holding piece r of each
    zigzag_ring_flash_attn_varlen_func   zigzag_ring_flash_attn_varlen.py: every document cut in
                                         2N chunks, rank r holding chunks r and 2N-1-r of each
    llama3_flash_attn_varlen_func        llama3_flash_attn_varlen.py: the packed sequence cut in N
                                         contiguous pieces (documents may straddle ranks); K, V
                                         all-gathered, heads_k_stride heads at a time

Its conventions, and what this adapter does about them:
- one packed sequence, no batch: q (T, Hq, D) with T this rank's tokens; the
  adapter runs B = 1 cases and drops / restores the batch dimension;
- each function's own sharding of the documents is the adapter's
  `positions` (per document for the ring and zigzag functions, so every
  document's length is a multiple of N, or of 2N for zigzag:
  `document_multiple`); the caller passes the local `cu_seqlens`
  (the global ones // N) to the ring and zigzag functions, and the global
  ones to `llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank,
  world_size)` for llama3, whose results it passes on;
- flash-attn's heads (h reads h // (Hq // Hkv)), scale argument, lse
  returned with `return_attn_probs=True` as (Hq, T), natural log (flash-attn
  2.6+'s varlen layout: the rings handle the older (B, Hq, max_seqlen) too);
- a window is flash-attn's `window_size=(W - 1, 0)` causal, `(W - 1, W - 1)`
  not (the kit's W keys, the query's own included);
- zigzag is causal only (it asserts causal); the others take both;
- dtypes as the dense rings (`conformance.ring_flash_attn_adapter`): float16 and
  bfloat16 declared to accumulate in their own dtype (each block's out comes
  back in it), float32 run through the stand-in, float64 not run;
- `llama3_flash_attn_varlen_func` is called with heads_k_stride = 1 (K, V
  gathered one kv head at a time; it requires Hkv % heads_k_stride == 0);
- padding (S not a multiple of N, or 2N): the padding tokens are the packed
  sequence's last ones. llama3 takes them as a document of their own, which
  no real query sees; the ring and zigzag functions cut every document in N
  (2N) equal pieces, so the padding (fewer tokens) joins the last document:
  causal, no real query sees it (it comes after them all); full attention
  would, so their full rows take no padding (the functions take no mask but
  cu_seqlens). Padding queries that attend: the harness's `loss_ignores_padding`;
- the backward is theirs (each function's autograd.Function saves q, k, v,
  out, lse), taken by the harness's autograd.
"""

import numpy as np

from reference.testing.harness.torch import TorchAdapter

from .ring_flash_attn_adapter import RingFlashAttn, load_rings, window_size

FUNCTIONS = {"ring": "ring_flash_attn_varlen_func", "zigzag": "zigzag_ring_flash_attn_varlen_func",
             "llama3": "llama3_flash_attn_varlen_func"}


def document_ranges(case, padding_alone=False):
    """[(start, end)] of every document (one, the whole sequence, without
    cu_seqlens) over the P positions: the padding (S .. P - 1) a document of
    its own, or the end of the last one."""
    cu = list(case.cu_seqlens if case.cu_seqlens is not None else (0, case.S))
    if case.padded > case.S:
        cu = cu + [case.padded] if padding_alone else cu[:-1] + [case.padded]
    return list(zip(cu[:-1], cu[1:]))


def per_document_positions(case, chunks_of_rank):
    """(N, c): rank r holds, document after document, the chunks `chunks_of_rank(r)`
    of each document cut in `len(...)`-many equal chunks."""
    n = case.n_devices
    rows = []
    for r in range(n):
        chunks, count = chunks_of_rank(r)
        row = []
        for start, end in document_ranges(case):            # (the padding joins the last document)
            size = (end - start) // count
            for i in chunks:
                row.extend(range(start + i * size, start + (i + 1) * size))
        rows.append(row)
    return np.array(rows)


class RingFlashAttnVarlen(RingFlashAttn):
    """The dense rings' dtypes, accumulation and preload; its own sharding and call."""
    max_batch = 1
    no_key_mask = None                  # (the padding is a document here: PADDING_IN_LAST_DOCUMENT)
    PADDING_IN_LAST_DOCUMENT = ("every document is cut in N equal pieces, so the padding (fewer than N tokens) "
                                "joins the last document, where full attention sees it; no mask but cu_seqlens")

    def __init__(self, function):
        self.function = function
        self.layouts = ("zigzag",) if function == "zigzag" else ("contiguous",)
        self.masks = ("causal", "window", "cu_seqlens") if function == "zigzag" else \
            ("causal", "full", "window", "cu_seqlens")                 # (zigzag asserts causal)
        self.masks += ("padding",)
        self.padding_alone = function == "llama3"
        self.unsupported = dict(self.unsupported)
        if function == "ring":
            self.unsupported["padding, full"] = self.PADDING_IN_LAST_DOCUMENT
        self.key = f"ring-flash-attn/{function}-varlen"
        self.name = f"ring-flash-attn {FUNCTIONS[function]}"

    def positions(self, case):
        n = case.n_devices
        if self.function == "ring":
            return per_document_positions(case, lambda r: ((r,), n))
        if self.function == "zigzag":
            return per_document_positions(case, lambda r: ((r, 2 * n - 1 - r), 2 * n))
        return super().positions(case)                       # llama3: contiguous over the packed sequence

    def document_multiple(self, n):
        return {"ring": n, "zigzag": 2 * n, "llama3": 1}[self.function]

    def supports(self, case):
        if case.B != 1:
            return "one packed sequence (B = 1)"
        if case.padded > case.S and not case.causal and not self.padding_alone:
            return self.PADDING_IN_LAST_DOCUMENT
        if any((end - start) % self.document_multiple(case.n_devices)
               for start, end in document_ranges(case, self.padding_alone)):
            return f"every document a multiple of {self.document_multiple(case.n_devices)} tokens"
        return TorchAdapter.supports(self, case)              # (not the dense rings': padding is a document here)

    def rings(self):
        """The module(s) whose functions (FUNCTIONS) run: ring-flash-attn's."""
        return load_rings()

    def compute(self, case, shard):
        import torch
        rings = self.rings()
        q, k, v = shard.q[0], shard.k[0], shard.v[0]                         # (c, H, D): no batch
        cu = torch.tensor([0] + [end for _, end in document_ranges(case, self.padding_alone)], dtype=torch.int32)
        options = dict(softmax_scale=case.scale_value, causal=case.causal, window_size=window_size(case),
                       return_attn_probs=True)
        if self.function == "llama3":
            cu_q, cu_k, max_q, max_k, k_slice = rings.llama3_flash_attn_prepare_cu_seqlens(
                cu, case.causal, shard.rank, shard.world_size)
            out, lse, _ = rings.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, **options)
        else:
            local = cu // shard.world_size                                   # each document's piece on this rank
            max_len = int((local[1:] - local[:-1]).max())
            out, lse, _ = getattr(rings, FUNCTIONS[self.function])(q, k, v, local, max_len, **options)
        return dict(out=out[None], lse=lse[None])                            # (1, c, Hq, D), (1, Hq, c)
