"""Hold other projects' ring attention against the oracle and write CONFORMANCE.md.

    make conformance                                       # what CI would not run: installs the peers extra
    peers/.venv/bin/python -m peers.conformance            # every peer, writes CONFORMANCE.md
    peers/.venv/bin/python -m peers.conformance --peer ring-flash-attn/zigzag --examples 10 --out -
    peers/.venv/bin/python -m peers.conformance --repro ring-attention-pytorch/striped backward "Case(...)"

For each peer (peers.PEERS), each dtype it takes, each mask set (causal /
full; a sliding window; packed documents: the last two where the peer takes
them, in float16 and bfloat16) and each pass (forward: out and lse; backward:
dq, dk, dv from autograd of sum(out * dout)), hypothesis draws cases
(`reference.testing.cases`, the peer's layout and positions, N in WORLD_SIZES)
and `check_ring_attention` holds every rank's results against the float64
oracle. A disagreement is shrunk to its smallest case (hypothesis replays the
minimal example last, so the last failure seen is it); the report gives it,
the kit's message, what explains it (FINDINGS, written by reading the peer's
code; "not classified" when none matches) and the command that reproduces it.
Examples are drawn from a fixed seed: the same versions give the same report.
"""

import argparse
import copy
import datetime
import functools
import platform
import re
import sys
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

from reference.testing import BACKWARD, FORWARD, Case, cases, check_ring_attention, parse_case
from reference.testing.compare import where_raised
from reference.testing.harness.torch import close_worlds

from . import PEERS

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZES = (2, 3, 4)        # gloo cannot send a rank to itself, which every ring here does at N = 1
LIBRARIES = ("striped-attention", "torch", "numpy", "ml_dtypes", "hypothesis", "ring-attention-pytorch",
             "ring-flash-attn", "axolotl-ringmaster", "yunchang")
PASSES = {"forward": FORWARD, "backward": BACKWARD}
# The matrix's mask columns: the kit's masks a set adds to causal / full, and what a case of it carries
# (cases without it are drawn again). Windows and documents run in the 16-bit dtypes the rings in use run.
MASK_SETS = {"causal / full": ((), lambda case: True),
             "window": (("window",), lambda case: case.window is not None),
             "documents": (("cu_seqlens",), lambda case: case.cu_seqlens is not None and len(case.cu_seqlens) > 2)}
MASKED_DTYPES = ("float16", "bfloat16")
REPRO = "{env}peers/.venv/bin/python -m peers.conformance --repro {peer} {phase} \"{case!r}\""

# What explains each disagreement, from reading the peer's code. A finding applies
# to a run whose peer key starts with `peer`, whose dtype, pass and mask set match
# (None or absent: any), whose message `match`es (a regular expression) and whose
# smallest case passes `when` (absent: any).
FINDINGS = [
    dict(peer="ring-attention-pytorch/", dtype=("float16", "bfloat16"), phase=None,
         match="expected scalar type Float but found", kind="defect (raises)",
         text="16-bit inputs (float16, bfloat16) raise in the forward: the running row maxima and sums are "
              "float32 (`all_row_sums`, `all_row_maxes`, ring_flash_attention.py lines 124-125), so `exp_weights` "
              "is float32 and `einsum('b h i j, b j h d -> b i h d', exp_weights, vc)` (line 204) meets 16-bit "
              "values."),
    dict(peer="ring-attention-pytorch/", dtype="float64", phase=None, match="cannot be converted to type float",
         kind="defect (raises)",
         text="float64 inputs raise in the forward: `torch.full((batch, heads, seq, 1), max_neg_value)` "
              "(ring_flash_attention.py line 125) makes a tensor of the default dtype, float32, filled with "
              "`max_neg_value = -torch.finfo(q.dtype).max` (line 119), which float32 cannot hold."),
    dict(peer="ring-attention-pytorch/contiguous", dtype=None, phase="forward", match=r"(out|lse): \d+ of",
         kind="defect",
         text="With a bucket size that does not divide the rank's block c, a query sees keys after it. "
              "Buckets are numbered `ring_rank * per_machine_buckets + index` (lines 152, 163) with "
              "`per_machine_buckets = per_machine_seq_size // bucket_size` (line 111), which ignores the "
              "shorter last bucket; `k.split(bucket_size)` makes it anyway, so bucket numbers of different "
              "ranks collide and a remote block is masked as if it were the diagonal block (`triu(1)`, "
              "line 189) or not at all. Divisibility is asserted only when `max_lookback_seq_len` is given "
              "(line 100). With one bucket per rank (the 'bucket = c' rows) the forward agrees."),
    dict(peer="ring-attention-pytorch/striped", dtype=None, phase="forward", match=r"(out|lse): \d+ of",
         kind="defect",
         text="With more than one bucket per rank, the striped mask is wrong. It is "
              "`triu(int(row_bucket_index >= col_bucket_index))` on each (query bucket, key bucket) pair "
              "(lines 183-185), with bucket numbers `rank * per_machine_buckets + index`: the rule for "
              "a whole striped block (the paper's GetMask: the diagonal is visible when the key's rank "
              "is not after the query's), applied to sub-blocks whose local offsets differ. Striped "
              "visibility between sub-blocks depends on the local offsets first (key local index < query "
              "local index, or equal and rank not after), so whole key buckets are masked or unmasked "
              "wrongly. With one bucket per rank (the 'bucket = c' rows) the forward agrees."),
    dict(peer="ring-attention-pytorch/", dtype=None, phase="backward", match="dk:",
         kind="defect",
         text="dK and dV come back wrong. After the last round the backward does "
              "`dkv = ring_pass(ring_size - max_ring_passes + 1, dkv)` and `dk, dv = dkv` "
              "(ring_flash_attention.py lines 383-385), but `ring_pass` returns the pair "
              "`(receive_buffer, x)` (ring.py line 77): `dk` is the received (dK, dV) stack, shape "
              "(2, B, c, Hkv, D), which is the rank's own keys' (the shift home is right), and `dv` is the "
              "stack it sent, rank r + 1's. Autograd sums each over the extra leading dimension instead "
              "of raising, so rank r returns dK + dV of its own keys as dk and dK + dV of rank r + 1's "
              "keys as dv (checked on N = 2 and 3: `peers/.venv/bin/python -m peers.conformance "
              "--explain-dkv`)."),
    dict(peer="ring-flash-attn/", dtype="float32", phase="backward", match=r"d[qkv]: \d+ of",
         kind="defect (float32 only, which flash-attn's kernels refuse)",
         text="float32 gradients are wrong: the backward starts its float32 accumulators with "
              "`dq = block_dq_buffer.to(torch.float32)` (and dk, dv; ring_flash_attn.py lines 134-136, "
              "zigzag_ring_flash_attn.py 164-166, stripe_flash_attn.py 202-204), which for float32 inputs returns "
              "the buffer itself, not a copy: the next block's kernel writes into that buffer, overwriting the sum, "
              "and `dq += block_dq_buffer` then adds the new block twice; dk and dv are sent from the buffer the "
              "next kernel overwrites. flash-attn itself takes only float16 and bfloat16, where `.to` copies; the "
              "stand-in takes float32, as a kernel that did would."),
    dict(peer="ring-flash-attn/", dtype="float32", phase="forward", match=r"out: \d+ of",
         when=lambda case: case.kind == "large_logits", kind="over the line (marginal)",
         text="A float32 out element just over the kit's line on scores in the hundreds: the ring merges blocks "
              "as `out - sigmoid(block_lse - lse) * (out - block_out)` (utils.py line 47), whose difference "
              "`out - block_out` and product round twice where the textbook weighted sum rounds once; read as "
              "rounding at the edge of the error model, not a wrong result (no smaller case fails)."),
    dict(peer="torch-cp/", dtype="float32", phase="forward", match=r"out: \d+ of",
         when=lambda case: case.kind == "large_logits", kind="over the line (marginal)",
         text="A float32 out element just over the kit's line on scores in the hundreds: `_SDPAMerger` merges "
              "blocks with ring-flash-attn's `out - sigmoid(block_lse - lse) * (out - block_out)` "
              "(_context_parallel/_attention.py line 186), which rounds twice where the weighted sum rounds "
              "once; read as rounding at the edge of the error model, not a wrong result (no smaller case "
              "fails)."),
    dict(peer="ring-flash-attn/llama3", dtype=None, phase=None, masks="window", when=lambda case: not case.causal,
         match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (windows, not causal)",
         text="A window without the causal mask is misplaced. `llama3_flash_attn_prepare_cu_seqlens` with "
              "causal=False lets the keys of this rank's last document run on to the document's end "
              "(llama3_flash_attn_varlen.py lines 49-52: 'when not causal, we hope the last k is full seq'), and "
              "the kernel places a window bottom-right, aligning a query with the key as many tokens later as the "
              "document runs past this rank: the window is measured from the wrong key. Causal windows, whose key "
              "slice ends with this rank's queries (lines 44-47), agree."),
    dict(peer="ring-flash-attn/", dtype=None, phase=None, masks="window", match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (windows)",
         text="A sliding window is wrong beyond the diagonal block. Every ring (ring_flash_attn.py lines 45-49 "
              "and 123-127, zigzag_ring_flash_attn.py 44-48, stripe_flash_attn.py 48-52, ring_flash_attn_varlen.py "
              "68-72, zigzag_ring_flash_attn_varlen.py 129-133, and their backwards) passes its `window_size` on to "
              "each block's kernel, which measures the window in the block's own local indices, bottom-right "
              "aligned, as if the block's keys were the query's own; a block that came round the ring holds keys "
              "whole blocks earlier, so keys inside the window are dropped and keys outside it kept. "
              "llama3_flash_attn_varlen_func gathers the keys each rank's queries need and calls the kernel once "
              "with aligned cu_seqlens: its causal windows agree."),
    dict(peer="torch-cp/", dtype="float64", phase=None, match=r"(out|lse|d[qkv]): \d+ of",
         kind="defect (float64 computed in float32)",
         text="float64 inputs come back with float32 precision: `_SDPAMerger.step` converts every block's out "
              "and lse to float32 before merging (`if self._convert_to_f32: out = out.to(torch.float32)`, "
              "_context_parallel/_attention.py lines 213-215; `convert_to_f32` is on by default, line 75, meant "
              "as an upcast for 16-bit inputs), and the backward accumulates dQ, dK, dV in float32 "
              "(`accum_dtype`, line 512). Held to the float32 line (`--accumulate float32`) it agrees."),
    dict(peer="torch-cp/no-balance/ALL_GATHER/negative-scale", dtype=None, phase=None,
         match=r"got nan", kind="defect (torch's CPU SDPA kernel)",
         text="Causal attention with a negative scale is NaN on every row, and not because of the ring: torch's "
              "CPU SDPA kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, what "
              "`torch.nn.functional.scaled_dot_product_attention` runs on a CPU) returns NaN for "
              "`scaled_dot_product_attention(q, k, v, is_causal=True, scale=-0.7)` on one process, and agrees "
              "with is_causal=False or a positive scale. Its C++ source (FlashAttentionKernel.cpp) is not in the "
              "wheel and was not read; NaN everywhere is what a mask of -inf multiplied by a negative scale "
              "(+inf) would give. The other rows skip these cases."),
    dict(peer="ringmaster/allgather", dtype=None, phase=None, masks="window", when=lambda case: not case.causal,
         match=r"(out|d[qkv]): \d+ of",
         kind="defect (windows without the causal mask)",
         text="A window without the causal mask is misplaced. `math_block` places the window bottom-right: "
              "`idx_q = arange(sq) + (sk - sq)` against all S gathered keys (kernels.py line 72), which is a "
              "query's global position only on the last rank, and it reads only the left size "
              "(`left, _ = window`, line 71), so keys after the query are never limited. Causal windows, whose "
              "gathered keys end with this rank's queries (`end = rank + 1`, loop.py), agree."),
    dict(peer="ringmaster/allgather", dtype=("float16", "bfloat16"), phase="backward", match=r"d[kv]: \d+ of",
         kind="over the line (16-bit partial gradients summed in 16 bits)",
         text="dK, dV of 16-bit inputs are summed across ranks in the input dtype: each rank's share comes back "
              "through `.float()` in the input dtype, and `_AllGatherKV.backward` adds the shares with "
              "`dist.all_reduce` on gloo (loop.py lines 83-90) in that dtype, one rounding per rank where a "
              "float32 sum would round once."),
    dict(peer="ringmaster/p2p", dtype=("float16", "bfloat16"), phase="backward", match=r"d[kv]: \d+ of",
         kind="over the line (16-bit GQA gradients summed in 16 bits)",
         text="With grouped heads, dK, dV of 16-bit inputs are rounded twice: `ring_p2p_attention` expands K, V "
              "with `repeat_interleave` before its autograd Function on a CPU (p2p_attn.py lines 286-290), whose "
              "backward returns each expanded head's float32 sum cast to the input dtype (line 281); autograd of "
              "`repeat_interleave` then adds the G heads' gradients in that dtype."),
    dict(peer="yunchang/", dtype=None, phase="backward", match="Not implemented backward",
         kind="not supported (its backward raises)",
         text="The backward raises: `RingAttentionFunc.backward` calls `pytorch_attn_backward`, whose body is "
              "`raise RuntimeError(\"Not implemented backward for PyTorch attention types\")` "
              "(kernels/attention.py line 159); only the forward of this ring runs."),
    dict(peer="yunchang/", dtype="float64", phase="forward", match=r"out: \d+ of",
         kind="defect (float64 computed in float32)",
         text="float64 inputs come back with float32 precision: the merge casts every block's out to float32 "
              "(`block_out.to(torch.float32)`, ring/utils.py lines 17 and 40) and the result is cast back to the "
              "input dtype only at the end."),
    dict(peer="bpt/", dtype="float64", phase=None, match="output types match",
         kind="not supported (float64 raises)",
         text="float64 inputs raise while tracing: with `float32_logits=True` (what llamabpt/llama.py passes, "
              "line 574) q and k are cast to float32 (bpt.py lines 28-29), so the running numerator, sum and max "
              "are float32 (lines 32-33, 62), while a block's `exp_values` meet float64 values (line 162) and a "
              "float64 bias (line 157, `dtype`): the two branches of the chunk skip's `lax.cond` (lines 182-188) "
              "return different dtypes and JAX refuses. With `float32_logits=False` the forward runs and the "
              "backward raises the same way: its dQ accumulator is float32 (line 74) against float64 blocks "
              "(line 277)."),
    dict(peer="bpt/", dtype="bfloat16", phase="backward", match=r"d[qkv]: \d+ of.*got 0\.0, expected -?\d\.\d+e-3[78]",
         when=lambda case: case.kind == "large_logits", kind="over the line (underflow near 1e-38)",
         text="A bfloat16 gradient of about 3e-38 comes back 0 on scores in the hundreds: bpt.py computes the "
              "backward in float32 (lines 74-76, 254-260), whose smallest normal is 1.2e-38 (bfloat16's too), "
              "and a product below it comes back 0 (XLA on the CPU flushes float32 subnormals to zero); the "
              "error is 3e-38 absolute, over the kit's line (1.4e-38) by a factor of 2-3. Read as underflow at "
              "the edge of the error model, not a wrong gradient (not checked further)."),
]


class Run:
    """One (peer, dtype, mask set, pass): the examples it ran and its smallest failure."""

    def __init__(self, peer, dtype, masks, phase):
        self.peer, self.dtype, self.masks, self.phase = peer, np.dtype(dtype).name, masks, phase
        self.adapter = for_pass(peer, phase)
        self.world_sizes, self.examples, self.failure, self.usage = Counter(), 0, None, {}

    def check(self, case):
        from hypothesis import reject
        if self.peer.supports(case) or not MASK_SETS[self.masks][1](case):
            reject()                   # not counted: hypothesis draws another
        self.examples += 1
        self.world_sizes[case.n_devices] += 1
        try:
            check_ring_attention(self.adapter, case, names=PASSES[self.phase], usage=self.usage)
        except AssertionError as e:
            self.failure = (case, str(e))
            raise
        except Exception as e:          # noqa: BLE001 - a peer that raises disagrees too
            if type(e).__name__ in ("UnsatisfiedAssumption",):
                raise
            self.failure = (case, f"raised {where_raised(str(e))}")
            raise

    def finding(self):
        if self.failure is None:
            return None
        for f in FINDINGS:
            if self.peer.key.startswith(f["peer"]) and _dtype_matches(f["dtype"], self.dtype) \
                    and f.get("masks", self.masks) == self.masks \
                    and f["phase"] in (None, self.phase) and re.search(f["match"], self.failure[1]) \
                    and ("when" not in f or (self.failure[0] is not None and f["when"](self.failure[0]))):
                return f
        return None


def _fixed_dtype(acc, dtype):
    return acc


def _dtype_matches(dtypes, name):
    """A finding's dtype: None (any), a name, or a tuple of names."""
    return dtypes is None or name in (dtypes if isinstance(dtypes, tuple) else (dtypes,))


def for_pass(peer, phase):
    """The peer as run for one pass: without its backward for the forward pass
    (so that a backward that raises does not fail the forward)."""
    adapter = copy.copy(peer)
    adapter.backward = phase == "backward"
    return adapter


def _last_lines(text, n=6):
    return "\n".join(text.strip().splitlines()[-n:])


def mask_sets(peer, dtype):
    """The mask sets a peer runs in `dtype`: causal / full always, a window and
    documents where it takes them (in MASKED_DTYPES)."""
    sets = ["causal / full"]
    if np.dtype(dtype).name in MASKED_DTYPES:
        sets += [name for name, (extra, _) in MASK_SETS.items() if extra and set(extra) <= set(peer.masks)]
    return sets


def strategy(peer, dtype, n, masks):
    plain = tuple(m for m in ("causal", "full") if m in peer.masks)
    return cases(dtypes=(dtype,), layouts=peer.layouts, devices=(n,), max_seq=48, max_head_dim=8,
                 masks=plain + MASK_SETS[masks][0], document_multiple=peer.document_multiple,
                 max_batch=getattr(peer, "max_batch", 2), shapes=getattr(peer, "shape_pool", 0),
                 keep=lambda case: not peer.supports(case))     # (a compiled ring compiles once a shape)


def run_one(peer, dtype, masks, phase, examples):
    """`examples` cases on each world size in turn, up to the first that disagrees
    (its smallest case is then on the smallest world size that shows it)."""
    from hypothesis import HealthCheck, Phase, given, seed, settings
    run = Run(peer, dtype, masks, phase)
    for n in WORLD_SIZES:
        # seed(0), not derandomize=True: as reproducible, and hypothesis shrinks a derandomized failure only part way
        @seed(0)
        # (no explain phase: it reruns a shrunk failure dozens of times to say which part matters)
        @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
                  phases=[p for p in Phase if p.name != "explain"],
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
        @given(strategy(peer, dtype, n, masks))
        def body(case):
            run.check(case)

        try:
            body()
        except Exception:              # noqa: BLE001 - the failure is recorded in run.failure
            if run.failure is None:
                run.failure = (None, traceback.format_exc())
            break
    return run


def versions():
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for name in LIBRARIES:          # (a run of some peers alone, --peer, needs only theirs)
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    # a peer that is not an installed package (bpt.py, a file at a commit) says its own version
    return {**found, **{peer.library: peer.version for peer in PEERS.values() if hasattr(peer, "version")}}


def report(runs, examples, seconds):
    v = versions()
    lines = [
        "# Conformance: other projects' ring attention against this project's oracle",
        "",
        f"Generated by `make conformance` (`python -m peers.conformance --examples {examples}`) on "
        f"{datetime.date.today().isoformat()}, {platform.machine()} {platform.system()}, Python "
        f"{platform.python_version()}, torch {v['torch']} (CPU, gloo), hypothesis {v['hypothesis']}; "
        f"{seconds:.0f} s on a shared 2-core machine. Every rank's results are held against the float64 "
        "oracle by `reference.testing.check_ring_attention`, element by element, within the kit's error "
        "model (README, 'Testing your own ring attention'). Each run draws up to "
        f"{examples} hypothesis cases (seed 0) of the peer's layout on each world size "
        f"{', '.join(map(str, WORLD_SIZES))} in turn (up to the first that disagrees), B <= 2 (1 for the varlen "
        "functions), S <= 48, GQA and MQA heads, D <= 8, causal or not (where the peer takes both), every input "
        "kind (scores in the hundreds, constant rows, values exact in float16), in each mask set the peer takes: "
        "causal / full; a sliding window (every case has one); packed documents (every case has two or more, "
        "`cu_seqlens`, each the length the function's sharding needs); windows and documents in float16 and "
        "bfloat16. A disagreement is shrunk to the smallest case hypothesis finds. Forward: out "
        "and lse; backward: dq, dk, dv by autograd of sum(out * dout). The adapters' conventions are in "
        "peers/*_adapter.py and below. Packages: " + ", ".join(f"{name} {v[name]}" for name in LIBRARIES) + ".",
        "",
        *summary(runs),
        "## Matrix",
        "",
        "| implementation | version | layout | dtype | masks | forward | backward |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    table = {}
    for run in runs:
        table.setdefault((run.peer.key, run.dtype, run.masks), {})[run.phase] = run
    for key in dict.fromkeys(run.peer.key for run in runs):
        peer = PEERS[key]
        rows = [(dtype, masks, [_cell(by_phase.get(phase)) for phase in PASSES])
                for (k, dtype, masks), by_phase in table.items() if k == key]
        rows += [(dtype, "any", [f"not supported: {why}"] * len(PASSES))
                 for dtype, why in getattr(peer, "unsupported", {}).items()]
        for dtype, masks, cells in rows:
            lines.append(f"| {peer.name} | {peer.library} {v[peer.library]} | {', '.join(peer.layouts)} | {dtype} | "
                         f"{masks} | " + " | ".join(cells) + " |")
    lines += ["", "A cell: *agrees*, or the disagreement below; then the examples run by world size "
              "(with those hypothesis ran while shrinking a disagreement); for a run that agrees, the "
              "largest error / tolerance of any element of each output (1 is the line; the project's "
              "own virtual ring reaches 0.27 in float32 and 0.98 in float16, where the final rounding "
              "alone can take it all: `python -m reference.testing measure`).", ""]
    for library in dict.fromkeys(run.peer.library for run in runs):
        peers = [p for p in PEERS.values() if p.library == library]
        lines += [f"## {library} {v[library]}", "", "Conventions (from the adapter):", ""]
        doc = sys.modules[getattr(peers[0], "conventions", type(peers[0]).__module__)].__doc__.strip()
        lines += ["> " + line if line else ">" for line in doc.splitlines()] + [""]
        for run in runs:
            if run.peer.library != library or run.failure is None:
                continue
            case, message = run.failure
            finding = run.finding()
            lines += [f"### {run.peer.name}, {run.dtype}, {run.masks}, {run.phase}: "
                      f"{finding['kind'] if finding else 'not classified'}", ""]
            if case is not None:
                lines += [f"Smallest case: `{case!r}`", "", "```", message.strip(), "```", "",
                          f"Reproduce: `{REPRO.format(env=getattr(run.peer, 'repro_env', ''), peer=run.peer.key, phase=run.phase, case=case)}`", ""]
            else:
                lines += ["```", _last_lines(message, 20), "```", ""]
            if finding:
                lines += [finding["text"], ""]
    return "\n".join(lines) + "\n"


def summary(runs):
    """Per implementation: agrees everywhere it ran, or each kind of disagreement in one sentence."""
    lines = ["## Summary", ""]
    for key in dict.fromkeys(run.peer.key for run in runs):
        mine = [run for run in runs if run.peer.key == key]
        failed = [run for run in mine if run.failure is not None]
        ran = f"{len(mine)} runs: " + ", ".join(dict.fromkeys(run.dtype for run in mine)) + "; " + \
            ", ".join(dict.fromkeys(run.masks for run in mine))
        if not failed:
            lines.append(f"- **{mine[0].peer.name}** agrees in every run ({ran}).")
            continue
        kinds = {}
        for run in failed:
            finding = run.finding()
            label = finding["kind"] if finding else "not classified"
            first = finding["text"].split(". ")[0].rstrip(".") + "." if finding else "see below."
            kinds.setdefault((label, first), []).append(f"{run.dtype} {run.masks} {run.phase}")
        lines.append(f"- **{mine[0].peer.name}** disagrees in {len(failed)} of {len(mine)} runs ({ran}):")
        lines += [f"  - {label} ({'; '.join(where)}): {first}" for (label, first), where in kinds.items()]
    return lines + [""]


def _cell(run):
    if run is None:
        return "not run"
    sizes = ", ".join(f"N={n}: {c}" for n, c in sorted(run.world_sizes.items()))
    if run.failure is None:
        used = ", ".join(f"{name} {run.usage[name]:.2g}" for name in PASSES[run.phase] if name in run.usage)
        return f"agrees ({run.examples}; {sizes}; line used: {used})"
    finding = run.finding()
    what = finding["kind"] if finding else "disagrees, not classified"
    return f"**{what}** ({run.examples}; {sizes})"


def repro(key, phase, case_text):
    case = parse_case(case_text)
    try:
        check_ring_attention(for_pass(PEERS[key], phase), case, names=PASSES[phase])
    except AssertionError as e:
        print(e)
        return 1
    except Exception as e:          # noqa: BLE001 - a peer that raises disagrees
        print(f"{PEERS[key].name} on {case!r} ({phase}): raised {where_raised(str(e))}")
        return 1
    print(f"{PEERS[key].name} agrees with the oracle on {case!r} ({phase})")
    return 0


def explain_dkv():
    """Checks the ring-attention-pytorch finding: rank r's dk is dK + dV of its
    own keys, its dv is dK + dV of rank r + 1's keys."""
    from reference.testing import make_shards, oracle
    peer = PEERS["ring-attention-pytorch/contiguous"]
    for n in (2, 3):
        case = Case("contiguous", n, 1, 2 * n, 2, 1, 3, None, True, None, np.float32, "gaussian", 0)
        pos = peer.positions(case)
        got = peer.run(case, make_shards(case, pos))
        both = oracle(case)["dk"] + oracle(case)["dv"]
        same = dict(rtol=1e-5, atol=1e-6)
        for r in range(n):
            own, right = np.take(both, pos[r], axis=1), np.take(both, pos[(r + 1) % n], axis=1)
            print(f"N={n} rank {r}: dk == dK + dV of its own keys: {np.allclose(got[r]['dk'], own, **same)}; "
                  f"dv == dK + dV of rank {(r + 1) % n}'s keys: {np.allclose(got[r]['dv'], right, **same)}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m peers.conformance", description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=30, help="hypothesis examples per (peer, dtype, pass)")
    ap.add_argument("--peer", action="append", choices=sorted(PEERS), help="only these (repeatable)")
    ap.add_argument("--dtype", action="append", help="only these dtypes (repeatable)")
    ap.add_argument("--masks", action="append", choices=list(MASK_SETS), help="only these mask sets (repeatable)")
    ap.add_argument("--pass", dest="passes", action="append", choices=list(PASSES), help="only these passes (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "CONFORMANCE.md"), help="the report ('-': stdout)")
    ap.add_argument("--accumulate", help="hold every peer to this accumulation dtype's line instead of its own")
    ap.add_argument("--repro", nargs=3, metavar=("PEER", "PASS", "CASE"), help="check one case and print the result")
    ap.add_argument("--explain-dkv", action="store_true", help="check the ring-attention-pytorch dK/dV finding")
    args = ap.parse_args(argv)
    if args.accumulate:
        for peer in PEERS.values():
            peer.accumulate_dtype = functools.partial(_fixed_dtype, np.dtype(args.accumulate))   # (picklable)
    try:
        if args.repro:
            return repro(*args.repro)
        if args.explain_dkv:
            return explain_dkv()
        start = datetime.datetime.now()
        plan = [(PEERS[key], dtype, masks, phase) for key in args.peer or PEERS for dtype in PEERS[key].dtypes
                if not args.dtype or np.dtype(dtype).name in args.dtype
                for masks in mask_sets(PEERS[key], dtype) if not args.masks or masks in args.masks
                for phase in PASSES if not args.passes or phase in args.passes]
        runs = []
        for i, (peer, dtype, masks, phase) in enumerate(plan, start=1):
            run = run_one(peer, dtype, masks, phase, args.examples)
            elapsed = (datetime.datetime.now() - start).total_seconds()
            print(f"[{i}/{len(plan)} {elapsed:4.0f} s] {peer.name} | {run.dtype} | {masks} | {phase}: {_cell(run)}",
                  flush=True)
            runs.append(run)
        text = report(runs, args.examples, (datetime.datetime.now() - start).total_seconds())
    finally:
        close_worlds()
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
