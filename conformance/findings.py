"""What explains each disagreement of the conformance runs, read from the peers' own code.

    from conformance.findings import classify
    finding = classify(run)        # the first FINDINGS entry that applies, or None

Each entry has a `key` (stored with the run it classified, conformance/results/),
`kind` (the matrix cell's words) and `text` (the explanation, with file and
line of the version that ran). NumPy only: CONFORMANCE.md is rendered from
the stored runs without torch.
"""

import re

# an out element over the line by less than 10 times it
MARGINAL = r"out: \d+ of [^\n]*> tolerance \S+ \(\d(\.\d+)?x\)"


def sigmoid_merge(peer, where, summary, whose=""):
    """The finding of a ring that merges its blocks with ring-flash-attn's
    sigmoid form (at `where`, file and line), in float32: a few outputs just
    over the line."""
    return dict(key=f"{peer}float32-sigmoid-merge", peer=peer, dtype="float32", phase="forward",
                kind="over the line (marginal)", summary=summary, match=MARGINAL,
                text=f"A float32 out element just over the kit's line (1.0x-2.8x): {whose}"
                     f"`out - sigmoid(block_lse - lse) * (out - block_out)` ({where}), which rounds twice where the "
                     "weighted sum `exp(lse - new) * out + exp(block_lse - new) * block_out` rounds once, on small "
                     "outputs that are differences of larger ones (scores in the hundreds, or values that cancel). "
                     "With the weighted sum in its place the same cases agree: `conformance/.venv/bin/python -m "
                     "conformance --explain-merge` (conformance/weighted_merge.py). Rounding at the edge of the "
                     "error model, not a wrong result.")


# What explains each disagreement, from reading the peer's code. A finding applies
# to a run whose peer key starts with `peer`, whose dtype, pass and mask set match
# (None or absent: any), whose message `match`es (a regular expression) and whose
# smallest case passes `when` (absent: any).
FINDINGS = [
    dict(key="ring-attention-pytorch/16-bit-raises",
         peer="ring-attention-pytorch/", dtype=("float16", "bfloat16"), phase=None,
         match="expected scalar type Float but found", kind="defect (raises)",
         summary="16-bit inputs raise in the forward: float32 running sums meet 16-bit values in an einsum (line "
                 "204).",
         text="16-bit inputs (float16, bfloat16) raise in the forward: the running row maxima and sums are "
              "float32 (`all_row_sums`, `all_row_maxes`, ring_flash_attention.py lines 124-125), so `exp_weights` "
              "is float32 and `einsum('b h i j, b j h d -> b i h d', exp_weights, vc)` (line 204) meets 16-bit "
              "values."),
    dict(key="ring-attention-pytorch/float64-raises",
         peer="ring-attention-pytorch/", dtype="float64", phase=None, match="cannot be converted to type float",
         kind="defect (raises)",
         summary="float64 inputs raise: a float32 tensor is filled with float64's most negative value (line 125).",
         text="float64 inputs raise in the forward: `torch.full((batch, heads, seq, 1), max_neg_value)` "
              "(ring_flash_attention.py line 125) makes a tensor of the default dtype, float32, filled with "
              "`max_neg_value = -torch.finfo(q.dtype).max` (line 119), which float32 cannot hold."),
    dict(key="ring-attention-pytorch/contiguous-buckets",
         peer="ring-attention-pytorch/contiguous", dtype=None, phase="forward", match=r"(out|lse): \d+ of",
         kind="defect",
         summary="A bucket size that does not divide the rank's block lets queries see later keys (bucket numbering, "
                 "lines 111, 152, 163).",
         text="With a bucket size that does not divide the rank's block c, a query sees keys after it. "
              "Buckets are numbered `ring_rank * per_machine_buckets + index` (lines 152, 163) with "
              "`per_machine_buckets = per_machine_seq_size // bucket_size` (line 111), which ignores the "
              "shorter last bucket; `k.split(bucket_size)` makes it anyway, so bucket numbers of different "
              "ranks collide and a remote block is masked as if it were the diagonal block (`triu(1)`, "
              "line 189) or not at all. Divisibility is asserted only when `max_lookback_seq_len` is given "
              "(line 100). With one bucket per rank (the 'bucket = c' rows) the forward agrees."),
    dict(key="ring-attention-pytorch/striped-buckets",
         peer="ring-attention-pytorch/striped", dtype=None, phase="forward", match=r"(out|lse): \d+ of",
         kind="defect",
         summary="With more than one bucket per rank the striped mask is the whole-block rule applied to sub-blocks, "
                 "wrongly (lines 183-185).",
         text="With more than one bucket per rank, the striped mask is wrong. It is "
              "`triu(int(row_bucket_index >= col_bucket_index))` on each (query bucket, key bucket) pair "
              "(lines 183-185), with bucket numbers `rank * per_machine_buckets + index`: the rule for "
              "a whole striped block (the paper's GetMask: the diagonal is visible when the key's rank "
              "is not after the query's), applied to sub-blocks whose local offsets differ. Striped "
              "visibility between sub-blocks depends on the local offsets first (key local index < query "
              "local index, or equal and rank not after), so whole key buckets are masked or unmasked "
              "wrongly. With one bucket per rank (the 'bucket = c' rows) the forward agrees."),
    dict(key="ring-attention-pytorch/dk-dv-swapped",
         peer="ring-attention-pytorch/", dtype=None, phase="backward", match="dk:",
         kind="defect",
         summary="dk comes back as dK + dV of the rank's own keys and dv as dK + dV of the next rank's (`ring_pass` "
                 "returns (received, sent), lines 383-385).",
         text="dK and dV come back wrong. After the last round the backward does "
              "`dkv = ring_pass(ring_size - max_ring_passes + 1, dkv)` and `dk, dv = dkv` "
              "(ring_flash_attention.py lines 383-385), but `ring_pass` returns the pair "
              "`(receive_buffer, x)` (ring.py line 77): `dk` is the received (dK, dV) stack, shape "
              "(2, B, c, Hkv, D), which is the rank's own keys' (the shift home is right), and `dv` is the "
              "stack it sent, rank r + 1's. Autograd sums each over the extra leading dimension instead "
              "of raising, so rank r returns dK + dV of its own keys as dk and dK + dV of rank r + 1's "
              "keys as dv (checked on N = 2 and 3: `conformance/.venv/bin/python -m conformance "
              "--explain-dkv`)."),
    dict(key="ring-flash-attn/dq-in-bfloat16",
         peer=("ring-flash-attn/contiguous", "ring-flash-attn/ring-varlen"), dtype="float32", phase="backward",
         match=r"dq: [^\n]*\(\d{1,3}(\.\d+)?x\)$", kind="defect (float32 only, which flash-attn's kernels refuse)",
         summary="float32 dq is returned rounded to bfloat16 (`dq.to(torch.bfloat16)`, line 154).",
         verdict="unclaimed",                      # flash-attn takes no float32
         text="float32 dq comes back rounded to bfloat16: `ring_flash_attn_backward` returns `dq.to(torch.bfloat16)` "
              "whatever the input dtype (ring_flash_attn.py line 154, ring_flash_attn_varlen.py line 192; the "
              "zigzag and stripe rings return `dq.to(q.dtype)`), and autograd casts it back: the dq got is the "
              "bfloat16 rounding of the expected one (`python -c \"import ml_dtypes, numpy as np; "
              "print(float(np.float32(-0.03556133511144763).astype(ml_dtypes.bfloat16)))\"` prints -0.03564453125, "
              "the smallest case's). Within the float16 line (flash-attn's own dtypes), outside the float32 one."),
    dict(key="ring-flash-attn/float32-buffer-alias",
         peer="ring-flash-attn/", dtype="float32", phase="backward", match=r"d[qkv]: \d+ of",
         kind="defect (float32 only, which flash-attn's kernels refuse)",
         summary="float32 gradients are wrong: `.to(torch.float32)` returns the kernel's reused buffer itself, which "
                 "the next block overwrites.",
         verdict="unclaimed",                      # flash-attn takes no float32
         text="float32 gradients are wrong: the backward starts its float32 accumulators with "
              "`dq = block_dq_buffer.to(torch.float32)` (and dk, dv; ring_flash_attn.py lines 134-136, "
              "zigzag_ring_flash_attn.py 164-166, stripe_flash_attn.py 202-204, ring_flash_attn_varlen.py 172-174, "
              "zigzag_ring_flash_attn_varlen.py 283-285), which for float32 inputs returns "
              "the buffer itself, not a copy: the next block's kernel writes into that buffer, overwriting the sum, "
              "and `dq += block_dq_buffer` then adds the new block twice; dk and dv are sent from the buffer the "
              "next kernel overwrites. flash-attn itself takes only float16 and bfloat16, where `.to` copies; the "
              "stand-in takes float32, as a kernel that did would."),
    sigmoid_merge("ring-flash-attn/", "utils.py line 47", whose="the ring merges blocks as ",
                  summary="float32 out just over the line: the sigmoid merge rounds twice (utils.py line 47); with "
                          "the weighted sum the same cases agree."),
    dict(key="torch-cp/float32-sigmoid-merge",
         peer="torch-cp/", dtype="float32", phase="forward", kind="over the line (marginal)",
         summary="float32 out just over the line: ring-flash-attn's sigmoid merge (line 186), which rounds twice.",
         match=MARGINAL,
         text="A float32 out element just over the kit's line (1.4x-2.6x): `_SDPAMerger` merges blocks with "
              "ring-flash-attn's `out - sigmoid(block_lse - lse) * (out - block_out)` "
              "(_context_parallel/_attention.py line 186), which rounds twice where the weighted sum rounds once; "
              "on the padding case it returns ring-flash-attn's and yunchang's element to the bit "
              "(0.0001157522201538086), and those agree with the weighted sum in its place "
              "(`conformance/.venv/bin/python -m conformance --explain-merge`). Rounding at the edge of the error "
              "model, not a wrong result."),
    dict(key="ring-flash-attn/llama3-window-not-causal",
         peer="ring-flash-attn/llama3", dtype=None, phase=None, masks="window", when=lambda case: not case.causal,
         match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (windows, not causal)",
         summary="A window without the causal mask is misplaced: the last document's keys run on to its end (lines "
                 "49-52).",
         text="A window without the causal mask is misplaced. `llama3_flash_attn_prepare_cu_seqlens` with "
              "causal=False lets the keys of this rank's last document run on to the document's end "
              "(llama3_flash_attn_varlen.py lines 49-52: 'when not causal, we hope the last k is full seq'), and "
              "the kernel places a window bottom-right, aligning a query with the key as many tokens later as the "
              "document runs past this rank: the window is measured from the wrong key. Causal windows, whose key "
              "slice ends with this rank's queries (lines 44-47), agree."),
    dict(key="ring-flash-attn/window-block-local",
         peer="ring-flash-attn/", dtype=None, phase=None, masks="window", match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (windows)",
         summary="A sliding window is measured in each block's local indices, so it is wrong beyond the diagonal "
                 "block.",
         text="A sliding window is wrong beyond the diagonal block. Every ring (ring_flash_attn.py lines 45-49 "
              "and 123-127, zigzag_ring_flash_attn.py 44-48, stripe_flash_attn.py 48-52, ring_flash_attn_varlen.py "
              "68-72, zigzag_ring_flash_attn_varlen.py 129-133, and their backwards) passes its `window_size` on to "
              "each block's kernel, which measures the window in the block's own local indices, bottom-right "
              "aligned, as if the block's keys were the query's own; a block that came round the ring holds keys "
              "whole blocks earlier, so keys inside the window are dropped and keys outside it kept. "
              "llama3_flash_attn_varlen_func gathers the keys each rank's queries need and calls the kernel once "
              "with aligned cu_seqlens: its causal windows agree."),
    dict(key="torch-cp/float64-in-float32",
         peer="torch-cp/", dtype="float64", phase=None, match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (float64 computed in float32)",
         summary="float64 is merged and differentiated in float32 (lines 213-215, 512).",
         text="float64 inputs come back with float32 precision: `_SDPAMerger.step` converts every block's out "
              "and lse to float32 before merging (`if self._convert_to_f32: out = out.to(torch.float32)`, "
              "_context_parallel/_attention.py lines 213-215; `convert_to_f32` is on by default, line 75, meant "
              "as an upcast for 16-bit inputs), and the backward accumulates dQ, dK, dV in float32 "
              "(`accum_dtype`, line 512). Held to the float32 line (`--accumulate float32`) it agrees."),
    dict(key="torch-cp/cpu-sdpa-negative-scale",
         peer="torch-cp/no-balance/ALL_GATHER/negative-scale", dtype=None, phase=None,
         match=r"got nan", kind="defect (torch's CPU SDPA kernel)",
         summary="torch's CPU SDPA kernel returns NaN for causal attention with a negative scale, with no ring "
                 "involved.",
         text="Causal attention with a negative scale is NaN on every row, and not because of the ring: torch's "
              "CPU SDPA kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, what "
              "`torch.nn.functional.scaled_dot_product_attention` runs on a CPU) returns NaN for "
              "`scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.7)` on one process, and agrees "
              "with is_causal=False or a positive scale. Its C++ source (FlashAttentionKernel.cpp) is not in the "
              "wheel and was not read; NaN everywhere is what a mask of -inf multiplied by a negative scale "
              "(+inf) would give. The other rows skip these cases."),
    dict(key="ringmaster/allgather-window-not-causal",
         peer="ringmaster/allgather", dtype=None, phase=None, masks="window", when=lambda case: not case.causal,
         match=r"(out|d[qkv]): \d+ of",
         kind="defect (windows without the causal mask)",
         summary="A window without the causal mask is misplaced: bottom-right alignment and the left size only "
                 "(kernels.py lines 71-72).",
         text="A window without the causal mask is misplaced. `math_block` places the window bottom-right: "
              "`idx_q = arange(sq) + (sk - sq)` against all S gathered keys (kernels.py line 72), which is a "
              "query's global position only on the last rank, and it reads only the left size "
              "(`left, _ = window`, line 71), so keys after the query are never limited. Causal windows, whose "
              "gathered keys end with this rank's queries (`end = rank + 1`, loop.py), agree."),
    dict(key="ringmaster/allgather-16-bit-dk-dv-sum",
         peer="ringmaster/allgather", dtype=("float16", "bfloat16"), phase="backward", match=r"d[kv]: \d+ of",
         kind="over the line (16-bit partial gradients summed in 16 bits)",
         summary="16-bit dK, dV shares are summed across ranks in 16 bits (loop.py lines 83-90), just over the line.",
         text="dK, dV of 16-bit inputs are summed across ranks in the input dtype: each rank's share comes back "
              "through `.float()` in the input dtype, and `_AllGatherKV.backward` adds the shares with "
              "`dist.all_reduce` on gloo (loop.py lines 83-90) in that dtype, one rounding per rank where a "
              "float32 sum would round once."),
    dict(key="ringmaster/p2p-16-bit-gqa-sum",
         peer="ringmaster/p2p", dtype=("float16", "bfloat16"), phase="backward", match=r"d[kv]: \d+ of",
         kind="over the line (16-bit GQA gradients summed in 16 bits)",
         summary="With grouped heads, 16-bit dK, dV are summed over the group in 16 bits (`repeat_interleave` outside"
                 " its Function), just over the line.",
         text="With grouped heads, dK, dV of 16-bit inputs are rounded twice: `ring_p2p_attention` expands K, V "
              "with `repeat_interleave` before its autograd Function on a CPU (p2p_attn.py lines 286-290), whose "
              "backward returns each expanded head's float32 sum cast to the input dtype (line 281); autograd of "
              "`repeat_interleave` then adds the G heads' gradients in that dtype."),
    dict(key="yunchang/backward-raises",
         peer="yunchang/", dtype=None, phase="backward", match="Not implemented backward",
         kind="not supported (its backward raises)",
         summary="No backward: it raises \"Not implemented backward for PyTorch attention types\" "
                 "(kernels/attention.py line 159).",
         text="The backward raises: `RingAttentionFunc.backward` calls `pytorch_attn_backward`, whose body is "
              "`raise RuntimeError(\"Not implemented backward for PyTorch attention types\")` "
              "(kernels/attention.py line 159); only the forward of this ring runs."),
    dict(key="yunchang/float64-in-float32",
         peer="yunchang/", dtype="float64", phase="forward", match=r"out: \d+ of",
         kind="defect (float64 computed in float32)",
         summary="float64 is merged in float32 (ring/utils.py lines 17, 40).",
         text="float64 inputs come back with float32 precision: the merge casts every block's out to float32 "
              "(`block_out.to(torch.float32)`, ring/utils.py lines 17 and 40) and the result is cast back to the "
              "input dtype only at the end."),
    dict(key="yunchang/window-ignored",
         peer="yunchang/ring-pytorch", dtype=None, phase="forward", masks="window", match=r"out: \d+ of",
         kind="defect (window ignored)",
         summary="`window_size` is accepted and silently dropped (ring_pytorch_attn.py line 28): every window is "
                 "wrong.",
         text="A sliding window is ignored, silently: `ring_pytorch_attn_func` takes `window_size` "
              "(ring/ring_pytorch_attn.py line 19) and drops it, calling `RingAttentionFunc.apply(group, q, k, v, "
              "softmax_scale, causal)` (line 28); its block kernel `pytorch_attn_forward` takes a `window_size` too "
              "(kernels/attention.py line 51) and does not pass it to SDPA (lines 66-73). Every query sees every key "
              "the causal mask (or none) lets it see."),
    sigmoid_merge("yunchang/", "ring/utils.py line 24", whose="the merge is ring-flash-attn's, ",
                  summary="float32 out just over the line: ring-flash-attn's sigmoid merge (ring/utils.py line 24); "
                          "with the weighted sum the case agrees."),
    dict(key="yunchang/ulysses-torch-attends-across-ranks",
         peer="yunchang/ulysses-torch-flash", dtype=None, phase="forward", match=r"out: \d+ of",
         kind="defect (attends to other ranks' heads)",
         text="UlyssesAttention with a PyTorch attention type attends across ranks. For `AttnType.TORCH_FLASH` "
              "(and TORCH_MATH, TORCH_EFFICIENT, TORCH_CUDNN) `select_flash_attn_impl(..., stage=\"fwd-bwd\")` "
              "returns `ring_pytorch_attn_func` (kernels/__init__.py lines 133-175), a ring, and "
              "`UlyssesAttention.forward` calls it without `group` (ulysses/attn_layer.py lines 101-113), so it runs "
              "on `group=None` (ring/ring_pytorch_attn.py line 24), the whole world: after the all-to-all each rank "
              "holds the whole sequence of its own heads, and the ring treats the other ranks' keys (other heads) "
              "as earlier or later blocks of one longer sequence. Under the causal mask rank 0 sees only its own "
              "block and is right; every other rank's heads are wrong (the smallest case, N = 2, S = 2: head 1's "
              "query 0, on rank 1, comes back as exactly the softmax over its own key 0 and rank 0's head-0 keys "
              "0 and 1, -0.8668 where attention gives -1.2654). With flash-attn (`AttnType.FA`, "
              "`flash_attn_func`) the same class agrees."),
    dict(key="yunchang/torch-math-zero-lse",
         peer="yunchang/usp-basic-torch-math", dtype=None, phase="forward", match=r"out: \d+ of",
         kind="defect (blocks merged with a zero lse)",
         text="With `AttnType.TORCH_MATH` the ring merges blocks with equal weights. The block kernel is "
              "`pytorch_attn_forward(op_type=\"math\")` (kernels/__init__.py lines 133-135), which returns "
              "`lse = torch.zeros(...)` (\"For math backend, LSE is not available, use zeros as fallback\", "
              "kernels/attention.py lines 107-108); `update_out_and_lse` (ring/utils.py line 24) then weighs each "
              "new block by sigmoid(0 - 0) = 1/2 whatever its softmax sum. A rank that sees one block (rank 0 "
              "under the causal mask) is right; from the second block on out is wrong (the smallest case, N = 2, "
              "S = 2, D = 1: rank 1's query comes back as exactly (v0 + v1) / 2, -0.0870, where the softmax "
              "weights give -0.0712). TORCH_CUDNN "
              "returns zeros the same way (line 130)."),
    dict(key="yunchang/extract-local-by-global-rank",
         peer="yunchang/usp-ring-groups-inner-", dtype=None, phase=None, masks="causal / full",
         when=lambda case: case.n_devices == 4, match=r"(out|d[qkv]): \d+ of",
         kind="defect (tokens dealt for the other rank numbering)",
         text="With `set_seq_parallel_pg(..., use_ulysses_low=False)` the basic and stripe USP get the wrong "
              "tokens from yunchang's own sharding helpers. That option makes the ring groups consecutive ranks "
              "and the Ulysses groups strided (globals.py lines 59-78), but `basic_extract_local` and "
              "`stripe_extract_local` cut the sequence by the global rank (`value.chunk(world_size)[rank]`, "
              "comm/extract_local.py lines 19 and 26), which is right only for Ulysses groups of consecutive "
              "ranks: with 2 x 2 on N = 4, S = 4, the Ulysses group {1, 3} gathers tokens 1 and 3 for ring rank 1, "
              "whose ring holds tokens 0 and 2 on ring rank 0, so under the causal mask token 1 sees token 2. "
              "`zigzag_extract_local` reads the ring and Ulysses group ranks (lines 38-45) and its rows agree; "
              "with the default `use_ulysses_low=True` all three agree. (With u = 1, N = 2 and 3, the option "
              "changes nothing.)"),
    dict(key="yunchang/varlen-flash-attn-before-2.6.3",
         peer="yunchang/", dtype=None, phase=None, match="unexpected keyword argument 'window_size'",
         kind="not supported (written for flash-attn before 2.6.3)",
         text="yunchang's varlen rings raise TypeError with flash-attn's current kernel API. They call "
              "`_flash_attn_varlen_forward(..., causal=..., window_size=window_size, ...)` and unpack eight "
              "results (ring/ring_flash_attn_varlen.py lines 56-67, zigzag_ring_flash_attn_varlen.py lines "
              "98-110), the API of flash-attn before 2.6.3; from 2.6.3 the kernel takes `window_size_left`, "
              "`window_size_right` and returns four results, which yunchang's dense kernel wrapper handles "
              "(`if flash_attn.__version__ < '2.6.3'`, kernels/attention.py lines 176-202) and its varlen rings "
              "do not. The stand-in takes the 2.6.3+ API. With an older flash-attn they are ring-flash-attn's "
              "varlen rings (its rows)."),
    dict(key="yunchang/pack-qkv-continous",
         peer="yunchang/usp-basic-pack-qkv", dtype=None, phase=None, match="has no attribute 'continous'",
         kind="defect (raises)",
         text="`LongContextAttention(use_pack_qkv=True)` raises on every call: it packs q, k, v with "
              "`torch.cat([query, key, value]).continous()` (hybrid/attn_layer.py line 88), a misspelling of "
              "`contiguous`, so the packed path has never run as released."),
    dict(key="yunchang/float32-buffer-alias",
         peer="yunchang/", dtype="float32", phase="backward", match=r"d[qkv]: \d+ of",
         kind="defect (float32 only, which flash-attn's kernels refuse)",
         verdict="unclaimed",                      # flash-attn takes no float32
         text="float32 gradients are wrong, as in ring-flash-attn whose rings these are: the backward starts its "
              "float32 accumulators with `dq = block_dq_buffer.to(torch.float32)` (and dk, dv; "
              "ring/ring_flash_attn.py lines 123-125, zigzag_ring_flash_attn.py 147-149, stripe_flash_attn.py "
              "164-166), which for float32 inputs is the buffer itself, not a copy: the next block's kernel "
              "overwrites the running sum. USP inherits it from its ring (hybrid/attn_layer.py line 128). "
              "flash-attn itself takes only float16 and bfloat16, where `.to` copies; the stand-in takes float32, "
              "as a kernel that did would."),
    dict(key="yunchang/window-block-local",
         peer="yunchang/", dtype=None, phase=None, masks="window", match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (windows)",
         text="A sliding window is wrong beyond the diagonal block, as in ring-flash-attn whose rings these are: "
              "each ring hands its `window_size` to every block's kernel (ring/ring_flash_attn.py lines 44 and "
              "115, zigzag_ring_flash_attn.py 38 and 132, stripe_flash_attn.py 45, 60, 132 and 156), which "
              "measures the window in the block's own local indices, bottom-right aligned, as if a block that "
              "came round the ring held the query's own keys. USP passes the window to its ring "
              "(hybrid/attn_layer.py lines 128-143) and inherits it; Ulysses alone, one kernel call on the whole "
              "sequence, agrees."),
    dict(key="ringmaster/ulysses-window-not-causal",
         peer="ringmaster/ulysses", dtype=None, phase=None, masks="window", when=lambda case: not case.causal,
         match=r"(out|d[qkv]): \d+ of",
         kind="defect (windows without the causal mask)",
         text="A window without the causal mask is limited on the left only. ringmaster takes Hugging Face's "
              "`sliding_window` and builds the mask `pos_q - pos_k < sliding_window` (strategies/ulysses.py line "
              "68, `_ulysses_varlen`), with the causal part added only when `is_causal` is not False (lines "
              "65-66): non-causal, a query sees every later key. (A causal sliding window, which is what Hugging "
              "Face models declare, is the one it was written for.)"),
    dict(key="ringmaster/usp-window-not-causal",
         peer="ringmaster/usp-allgather", dtype=None, phase=None, masks="window", when=lambda case: not case.causal,
         match=r"(out|d[qkv]): \d+ of",
         kind="defect (windows without the causal mask)",
         text="A window without the causal mask is limited on the left only: with a sliding window USP takes "
              "the gathered, doc-masked path (strategies/usp.py lines 126-148, `varlen_ring_attention`), whose "
              "mask is `qidx - kidx <= window[0]` (ring/loop.py line 186) on top of the causal part only when "
              "causal (lines 183-184): non-causal, a query sees every later key."),
    dict(key="ringmaster/usp-window-16-bit-sdpa",
         peer="ringmaster/usp-allgather", dtype=("float16", "bfloat16"), phase="forward", masks="window",
         match=r"out: \d+ of", kind="over the line (the windowed path computes in 16 bits)",
         text="With a sliding window, USP's out is rounded in the input dtype: the window sends it from "
              "`math_block`, which computes in float32, to `varlen_ring_attention`, whose CPU path calls "
              "`scaled_dot_product_attention` on the input dtype (ring/loop.py lines 188-197), and torch's CPU "
              "SDPA rounds in it. Held to the 16-bit line (`--accumulate float16`, `--accumulate bfloat16`: the "
              "smallest case here agrees), the same run's smallest failure is the non-causal window above "
              "(left side only, loop.py line 186)."),
    dict(key="ringmaster/usp-documents-16-bit-sdpa",
         peer="ringmaster/usp-allgather", dtype=("float16", "bfloat16"), phase="forward", masks="documents",
         match=r"out: \d+ of", kind="over the line (the documents' path computes in 16 bits)",
         text="With packed documents, USP's out is rounded in the input dtype: documents send it from "
              "`math_block`, which computes in float32, to `varlen_ring_attention`, whose CPU path calls "
              "`scaled_dot_product_attention` on the input dtype with the document mask (ring/loop.py lines "
              "178-197), and torch's CPU SDPA rounds in it. Held to the 16-bit line (`--accumulate float16`, "
              "`--accumulate bfloat16`: 120 examples each, N = 2, 3, 4) the documents agree."),
    dict(key="ringmaster/usp-allgather-16-bit-dk-dv-sum",
         peer="ringmaster/usp-allgather", dtype=("float16", "bfloat16"), phase="backward", match=r"d[kv]: \d+ of",
         kind="over the line (16-bit partial gradients summed in 16 bits)",
         text="dK, dV of 16-bit inputs are summed across the ring's ranks in the input dtype, as in the all-gather "
              "ring alone: `_AllGatherKV.backward` adds each rank's share with `dist.all_reduce` on gloo "
              "(ring/loop.py lines 83-90) in that dtype, one rounding per rank where a float32 sum would round "
              "once."),
    dict(key="ringmaster/usp-p2p-16-bit-gqa-sum",
         peer="ringmaster/usp-p2p", dtype=("float16", "bfloat16"), phase="backward", match=r"d[kv]: \d+ of",
         kind="over the line (16-bit GQA gradients summed in 16 bits)",
         text="With grouped heads, dK, dV of 16-bit inputs are rounded twice, as in the p2p ring alone: "
              "`ring_p2p_attention` expands K, V with `repeat_interleave` before its autograd Function on a CPU "
              "(ring/p2p_attn.py lines 286-290), whose backward returns each expanded head's float32 sum cast to "
              "the input dtype (line 281); autograd of `repeat_interleave` then adds the G heads' gradients in "
              "that dtype."),
    dict(key="bpt/float64-raises",
         peer="bpt/", dtype="float64", phase=None, match="output types match",
         kind="not supported (float64 raises)",
         summary="float64 raises while tracing: float32 running sums meet float64 blocks in a `lax.cond` (lines "
                 "182-188).",
         text="float64 inputs raise while tracing: with `float32_logits=True` (what llamabpt/llama.py passes, "
              "line 574) q and k are cast to float32 (bpt.py lines 28-29), so the running numerator, sum and max "
              "are float32 (lines 32-33, 62), while a block's `exp_values` meet float64 values (line 162) and a "
              "float64 bias (line 157, `dtype`): the two branches of the chunk skip's `lax.cond` (lines 182-188) "
              "return different dtypes and JAX refuses. With `float32_logits=False` the forward runs and the "
              "backward raises the same way: its dQ accumulator is float32 (line 74) against float64 blocks "
              "(line 277)."),
    dict(key="bpt/16-bit-gradients-in-float32",
         peer="bpt/striped/gradients-as-returned", dtype=("float16", "bfloat16"), phase="backward",
         match=r"d[qk]: rank \d+ returned float32, expected the input dtype", kind="defect (dQ, dK in float32)",
         summary="16-bit inputs get dQ and dK back in float32: the backward casts to the dtypes of its residuals, "
                 "q and k already cast to float32 (lines 29, 66, 107).",
         text="16-bit inputs get dQ and dK back in float32 (dV in v's dtype): `_ring_attention_bwd` ends with "
              "`dq.astype(q.dtype), dk.astype(k.dtype)` (bpt.py line 107), but its q and k are the residuals the "
              "forward saved (line 66) after `q, k = q.astype(jnp.float32), k.astype(jnp.float32)` "
              "(`float32_logits`, line 29). JAX lets the custom VJP's float32 cotangents through. The other bpt "
              "rows cast them to the input dtype in the adapter (`gradient_in_dtype`), so that their values are "
              "checked; this row takes them as returned."),
    # (before the 16-bit dP: a padding case of the chunked rows fails by the bias first)
    dict(key="bpt/padding-bias-chunks",
         peer=("bpt/striped/chunked", "bpt/normal/chunked"), dtype=None, phase=None, masks="padding",
         match=r"(out|lse|d[qkv]): \d+ of", kind="defect (padding with several chunks)",
         summary="With several chunks a block, the padding bias is read at the wrong keys: the block's bias is "
                 "sliced again at global key offsets (lines 52-54, 424-428).",
         text="With several chunks a device block, the attention bias (here the padding mask llamabpt/llama.py "
              "builds: finfo.min on padding keys) lands on the wrong keys. The ring first cuts the key block's "
              "bias out of the whole (B, 1, 1, N c) bias (`attn_bias_slice`, bpt.py lines 52-54), then "
              "`_chunk_attention_bias` cuts each key chunk's bias out of that slice at `key_offset = key_chunk_idx "
              "* key_chunk_size` (lines 421-428) with `key_chunk_idx` global (`k_chunk_idx_start + k_chunk_idx`, "
              "lines 58 and 156): for any block but device 0's the offset is past the slice and "
              "`lax.dynamic_slice` clamps it to the block's last chunk, whose bias every chunk then gets, so real "
              "keys are masked and padding keys seen. With one chunk a block (the other bpt rows) the clamp "
              "lands on offset 0, which is right. Without padding the bias is all zero and nothing shows."),
    dict(key="bpt/16-bit-dP",
         peer="bpt/", dtype=("float16", "bfloat16"), phase="backward", match=r"d[qkv]: \d+ of",
         kind="over the line (16-bit dP)",
         summary="16-bit gradients: each dP = dO V^T is rounded to 16 bits (`ds`, line 256); with that einsum in "
                 "float32 the same runs agree.",
         text="16-bit gradients go over the line: the backward computes each block's dP = dO V^T as "
              "`ds = jnp.einsum(\"bqhd,bkhd->bhqk\", g_chunk, value_chunk)` (bpt.py line 256) from the cotangent "
              "g, which is in v's dtype (out is returned in it, line 66), and v, so every dP is rounded to 16 bits "
              "before the float32 `dl = (ds - dl_part) * exp_weights` (line 257) reads it: dS carries a relative "
              "error of 2**-11 (float16) or 2**-8 (bfloat16) where the rest of the backward keeps float32. With the "
              "einsum's operands cast to float32 (that line alone changed) the striped ring agrees on 40 examples "
              "per world size, N = 2, 3, 4, float16 and bfloat16 cases drawn, causal, full and padding (`python -m "
              "reference.testing check conformance/bpt_adapter.py:BptStriped --dtypes float16,bfloat16 --masks "
              "causal,full,padding --examples 40`, BPT naming the changed file). A loss of precision, not a "
              "wrong formula."),
]
BY_KEY = {f["key"]: f for f in FINDINGS}


def classify(run):
    """The first finding that applies to `run` (a conformance.results.Run that failed), or None."""
    if run.failure is None:
        return None
    case, message = run.failure
    for f in FINDINGS:
        if run.peer.key.startswith(f["peer"]) and _dtype_matches(f["dtype"], run.dtype) \
                and f.get("masks", run.masks) == run.masks and f["phase"] in (None, run.phase) \
                and re.search(f["match"], message) \
                and ("when" not in f or (case is not None and f["when"](case))):
            return f
    return None


def _dtype_matches(dtypes, name):
    """A finding's dtype: None (any), a name, or a tuple of names."""
    return dtypes is None or name in (dtypes if isinstance(dtypes, tuple) else (dtypes,))
