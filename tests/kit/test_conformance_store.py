"""The conformance results store (conformance/results.py): runs saved one at a time, read
back as they were, and CONFORMANCE.md rendered from all of them. NumPy only: no
torch, no peer is run; the runs are made by hand.

    python -m pytest -q tests/kit/test_conformance_store.py
"""

import json
import subprocess
import sys
from collections import Counter

import numpy as np

from conformance import page, results
from conformance.results import Peer, Run
from reference.testing import Adapter, Case

WINDOWED = Peer(key="ring-flash-attn/zigzag", name="ring-flash-attn zigzag_ring_flash_attn_func",
                library="ring-flash-attn", layouts=("zigzag",), conventions="Zigzag.\n\nIts conventions.",
                unsupported={"float64": "flash-attn takes 16-bit dtypes"})
CONTROL = Peer(key="examples/torch_ring", name="examples.torch_ring", library="striped-attention",
               layouts=("contiguous", "striped"), conventions="The example ring.")
# the smallest case of a disagreement, with a window: what FINDINGS' ring-flash-attn window entry explains
SMALLEST = Case(layout="zigzag", n_devices=2, B=1, S=4, Hq=1, Hkv=1, D=1, tile_size=None, causal=True, scale=None,
                dtype=np.float16, kind="gaussian", seed=0, window=2)
MESSAGE = "out: 1 of 4 elements outside the tolerance; first at (0, 3, 0, 0): got 0.5, expected 0.25"
VERSIONS = {"striped-attention": "0.1.0", "numpy": "2.4.6", "ml_dtypes": "0.7.0", "hypothesis": "6.170.17",
            "torch": "2.13.0+cpu", "ring-flash-attn": "0.1.8", "python": "3.11.7", "platform": "x86_64 Linux"}


def agreeing(peer=CONTROL, dtype="float32", masks="causal / full", phase="forward", date="2026-12-02", **versions):
    return Run(peer, dtype, masks, phase, examples=120, world_sizes=Counter({2: 40, 3: 40, 4: 40}),
               usage={"out": 0.25, "lse": 0.125}, asked=40, seconds=12.5, date=date,
               versions={**VERSIONS, **versions})


def failing(phase="forward"):
    return Run(WINDOWED, "float16", "window", phase, examples=7, world_sizes=Counter({2: 7}),
               failure=(SMALLEST, MESSAGE), asked=40, seconds=3.0, date="2026-12-02", versions=VERSIONS)


def everything(runs, planned=()):
    """CONFORMANCE.md and every library page, as one text."""
    return page.render(runs, planned) + "".join(page.render_pages(runs).values())


def test_a_run_comes_back_as_it_was_saved_failure_case_and_finding_included(tmp_path):
    for run in (agreeing(), failing(), Run(CONTROL, "float64", "causal / full", "backward",
                                           failure=(None, "Traceback ...\nRuntimeError: boom"), date="2026-12-02")):
        results.save(run, tmp_path)
    back = {run.cell: run for run in results.load(tmp_path)}
    assert back[("float32", "causal / full", "forward")] == agreeing()
    got = back[("float16", "window", "forward")]
    assert got.failure == (SMALLEST, MESSAGE) and isinstance(got.failure[0], Case)      # parse_case'd back
    assert got.finding()["key"] == "ring-flash-attn/window-block-local"
    assert got.stored_finding == "ring-flash-attn/window-block-local"                   # kept with the run
    assert back[("float64", "causal / full", "backward")].failure == (None, "Traceback ...\nRuntimeError: boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples__torch_ring.json", "ring-flash-attn__zigzag.json"]


def test_a_rerun_replaces_only_its_own_cell(tmp_path):
    results.save(agreeing(), tmp_path)
    results.save(agreeing(phase="backward"), tmp_path)
    again = agreeing()
    again.examples, again.world_sizes = 3, Counter({2: 3})
    again.failure = (SMALLEST, MESSAGE)
    results.save(again, tmp_path)
    runs = results.load(tmp_path)
    assert [(run.phase, run.examples) for run in runs] == [("forward", 3), ("backward", 120)]


def test_the_page_shows_every_stored_run_with_its_repro_and_explanation(tmp_path):
    results.save(agreeing(), tmp_path)
    results.save(failing(), tmp_path)
    page = everything(results.load(tmp_path, order=["ring-flash-attn/zigzag"]))
    rows = [line for line in page.splitlines() if line.startswith("| ring-flash-attn") or
            line.startswith("| examples")]
    assert rows == [
        "| ring-flash-attn zigzag_ring_flash_attn_func | ring-flash-attn 0.1.8 | zigzag | float64 | any | "
        "not supported: flash-attn takes 16-bit dtypes | not supported: flash-attn takes 16-bit dtypes |",
        "| ring-flash-attn zigzag_ring_flash_attn_func | ring-flash-attn 0.1.8 | zigzag | float16 | window | "
        "**defect (windows)** (7; N=2: 7) | not run |",
        "| examples.torch_ring | striped-attention 0.1.0 | contiguous, striped | float32 | causal / full | "
        "agrees (120; N=2: 40, N=3: 40, N=4: 40; line used: out 0.25, lse 0.12) | not run |"]
    assert f"Smallest case: `{SMALLEST!r}`" in page and MESSAGE in page
    assert (f"Reproduce: `conformance/.venv/bin/python -m conformance --repro ring-flash-attn/zigzag forward "
            f"\"{SMALLEST!r}\"`") in page
    assert "A sliding window is wrong beyond the diagonal block." in page
    assert "> Zigzag.\n>\n> Its conventions." in page
    assert "on 2026-12-02," in page and "torch 2.13.0+cpu;" in page and "16 s of runs" in page


def test_the_header_names_each_runs_date_and_versions_where_they_differ(tmp_path):
    results.save(agreeing(), tmp_path)
    results.save(agreeing(peer=WINDOWED, dtype="float16", date="2026-12-03", torch="2.12.0"), tmp_path)
    page = everything(results.load(tmp_path))
    assert "on 2026-12-02 (examples/torch_ring) and 2026-12-03 (ring-flash-attn/zigzag)" in page
    assert "torch 2.13.0+cpu (examples/torch_ring) and 2.12.0 (ring-flash-attn/zigzag)" in page
    assert "numpy 2.4.6;" in page


def test_rendering_imports_neither_torch_nor_any_peer():
    code = ("import sys, conformance.results; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax') or m.endswith('_adapter')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_stored_file_is_plain_json_a_reader_can_diff(tmp_path):
    results.save(failing(), tmp_path)
    stored = json.loads((tmp_path / "ring-flash-attn__zigzag.json").read_text())
    assert stored["peer"]["key"] == "ring-flash-attn/zigzag"
    assert stored["runs"][0]["failure"] == {"case": repr(SMALLEST), "message": MESSAGE}
    assert stored["runs"][0]["world_sizes"] == {"2": 7} and stored["runs"][0]["finding"] == \
        "ring-flash-attn/window-block-local"


def test_a_finding_stored_with_a_run_explains_it_where_findings_no_longer_match(tmp_path):
    # (a failure without a case: FINDINGS' `when` cannot be asked; the key stored when it ran still names it)
    run = Run(WINDOWED, "float32", "causal / full", "backward", failure=(None, "Traceback ...\nboom"),
              stored_finding="ring-flash-attn/float32-buffer-alias", date="2026-12-02")
    results.save(run, tmp_path)
    (back,) = results.load(tmp_path)
    assert back.finding()["key"] == "ring-flash-attn/float32-buffer-alias"
    assert "**defect (float32 only, which flash-attn's kernels refuse)** (0; )" in everything([back])


def test_what_a_peer_does_not_take_is_a_row_of_a_dtype_or_of_a_mask_set():
    peer = Peer(key="p/q", name="p q", library="p", layouts=("contiguous",),
                unsupported={"float64": "no float64", "padding, full": "no key mask"})
    page = everything([agreeing(peer=peer)])
    assert "| p q | p ? | contiguous | float64 | any | not supported: no float64 | not supported: no float64 |" in page
    assert "| p q | p ? | contiguous | any | padding, full | not supported: no key mask | not supported: no key mask |" \
        in page


def test_a_peer_with_no_key_mask_has_a_padding_full_row_where_it_takes_both():
    class Blind(Adapter):
        key, name, library, layouts = "p/q", "p q", "p", ("contiguous",)
        masks, unsupported, no_key_mask = ("causal", "full", "padding"), {"float64": "no float64"}, "no key mask"

    assert Peer.of(Blind()).unsupported == {"float64": "no float64", "padding, full": "no key mask"}
    assert Peer.of(type("Causal", (Blind,), dict(masks=("causal", "padding")))()).unsupported == \
        {"float64": "no float64"}                           # no full rows: nothing to say of them
    assert Peer.of(type("Masked", (Blind,), dict(no_key_mask=None))()).unsupported == {"float64": "no float64"}


def test_the_summary_puts_a_peer_whose_only_disagreement_is_rounding_among_those_that_agree():
    marginal = Run(CONTROL, "float32", "causal / full", "forward", examples=50, world_sizes=Counter({2: 40, 3: 10}),
                   failure=(SMALLEST, "out: 1 of 4 elements out of tolerance; first at (0, 3, 0, 0): got 0.5, "
                                      "expected 0.25, error 3e-08 > tolerance 2e-08 (1.5x)"),
                   stored_finding="ring-flash-attn/float32-sigmoid-merge", date="2026-12-02")
    lines = page.summary([agreeing(), marginal, failing()])
    agree, disagree = lines[lines.index("**Agree everywhere they claim to work** (what disagrees is outside what "
                                        "they claim, or rounding just over the line, as said):"):], []
    split = next(i for i, line in enumerate(agree) if line.startswith("**Disagree**"))
    agree, disagree = agree[:split], agree[split:]
    assert any(line.startswith("- **examples.torch_ring** (2 runs, 1 agree") and "sigmoid merge" in line
               for line in agree)
    assert "- **ring-flash-attn zigzag_ring_flash_attn_func** (1 runs, 0 agree: float16; window):" in disagree
    assert any("[defect (windows)](pages/ring-flash-attn.md#window-block-local) (float16: window "
               "(forward)): A sliding window is measured" in line for line in disagree)


def test_a_finding_is_written_out_once_per_library_and_pointed_to_after():
    text = everything([failing("forward"), failing("backward")])
    assert text.count("A sliding window is wrong beyond the diagonal block. Every ring") == 1
    assert ('(Explained under "ring-flash-attn zigzag_ring_flash_attn_func, float16, window, forward: '
            'defect (windows)" above.)') in text


def test_a_planned_cell_that_is_not_stored_shows_as_not_run():
    never = Peer(key="x/y", name="x y", library="x", layouts=("striped",))
    text = page.render([agreeing()], planned=[(CONTROL, "float32", "causal / full"), (CONTROL, "float16", "window"),
                                              (never, "float64", "causal / full")])
    assert "| [examples.torch_ring][1] | contiguous, striped | - | 1/1 agree | 2 not run | - |" in text
    assert "| x y | striped | 2 not run | - | - | - |" in text and "[1]: pages/examples.md\n" in text
    assert "**Not run yet**: x y (`python -m conformance --missing`)." in text
    assert "(1 runs, 1 agree: float32; causal / full; 1 rows not run)" in text


def test_a_cell_planned_for_both_passes_is_counted_once_per_pass():
    """The runner plans a cell once per pass: the page counts its runs not stored, not its plan's lines."""
    text = page.render([agreeing()], planned=[(CONTROL, "float16", "window")] * 2)
    assert "| - | 1/1 agree | 2 not run | - |" in text


def test_todays_findings_classify_a_stored_run_before_the_one_stored_with_it():
    """A finding written since a run was stored explains it (FINDINGS read now);
    the finding stored with the run is only for runs today's findings do not match."""
    run = failing()
    run.stored_finding = "ring-flash-attn/float32-buffer-alias"        # what explained it when it ran
    assert run.finding()["key"] == "ring-flash-attn/window-block-local"


def test_the_pages_do_not_depend_on_the_order_runs_come_in(tmp_path):
    """The runner passes its peers' order, a test the store's: both render the same."""
    runs = [agreeing(), failing(), agreeing(peer=WINDOWED, dtype="float16"), failing("backward")]
    assert page.render(runs) == page.render(runs[::-1])
    assert page.render_pages(runs) == page.render_pages(runs[::-1])


def test_the_pages_are_the_stored_runs_rendered_byte_for_byte():
    """conformance/pages/ is what the store renders: `--render` rebuilds each page
    as committed (a page edited by hand, or a run stored without rendering, fails)."""
    folder = results.HERE / page.PAGES
    pages = page.render_pages(results.load())
    assert sorted(p.name for p in folder.glob("*.md")) == sorted(pages)
    for name, text in pages.items():
        assert (folder / name).read_text() == text, name


def test_conformance_md_is_a_summary_under_60_kib_whose_links_reach_the_pages():
    import re
    text = (results.HERE / "CONFORMANCE.md").read_text()
    assert len(text.encode()) < 60 * 1024
    links = re.findall(r"^\[\d+\]: (pages/[^#\s]+)(?:#(\S+))?$", text, re.M)
    assert len(links) > 10 and not re.search(r"\]\(pages/[^)]", text)     # each target once, by number
    for path, anchor in links:
        target = (results.HERE / path).read_text()
        anchors = set(re.findall(r'<a id="([^"]+)"></a>', target))
        assert not anchor or anchor in anchors, (path, anchor)


def test_the_command_line_helps_and_checks_its_options_without_torch():
    """`python -m conformance --help` needs neither torch nor a peer; a bad option
    is a usage error naming it, before any peer is imported."""
    code = ("import sys\nfrom conformance.__main__ import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)")
    for argv, said in ((["--help"], "--examples EXAMPLES"), (["--examples", "0"], "--examples must be at least 1"),
                       (["--out", "/no/such/folder/x.md"], "--out: no folder")):
        got = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=results.HERE.parent)
        assert got.stdout.splitlines()[-1] == f"exit {0 if argv == ['--help'] else 2} False", got.stderr
        assert said in got.stdout + got.stderr
