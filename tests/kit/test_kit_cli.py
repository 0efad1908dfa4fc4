"""The kit's command line, `python -m reference.testing check MODULE:ADAPTER`.

Pointed at the toy ring of tests/kit/test_kit.py it says "agrees" (exit 0) on
every mask and dtype; pointed at the same ring with a planted bug it prints
the smallest case hypothesis finds, the first bad element and a command that
replays it, and exits 1; a mistake on the command line exits 2 with words.
The checks run in this process through `main(argv)` (a second Python would
import hypothesis again); one subprocess shows the real entry point.

    .venv/bin/python -m pytest tests/kit/test_kit_cli.py -q
"""

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reference.testing import Adapter, VirtualRingAdapter, cases
from reference.testing.__main__ import main
from reference.testing.check import Progress, load_adapter, make_plan
from test_kit import ToyRing, VarlenToyRing

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--quiet", "--seed", "1"]


# the adapters the command line loads from this module (MODULE:ADAPTER = test_kit_cli:NAME)
WINDOW_TOO_WIDE = ToyRing("window")
OFFSETS_WRONG = VarlenToyRing("rank-offsets")


class Raises(VirtualRingAdapter):
    """A ring that raises on every case with more than one device."""
    name = "raising ring"
    masks = ("causal", "full")

    def run(self, case, shards):
        if case.n_devices > 1:
            raise ValueError("shapes do not match")
        return super().run(case, shards)


class NoSingleRank(ToyRing):
    """A ring that cannot run on one rank (as gloo cannot send a rank to itself)."""

    def supports(self, case):
        return "one rank: no ring" if case.n_devices == 1 else super().supports(case)


class WrongOnce(ToyRing):
    """A ring wrong the first time it meets a case with more than one rank, right after."""
    name = "wrong-once ring"
    masks = ("causal", "full")

    def __init__(self):
        super().__init__()
        self.seen = set()

    def run(self, case, shards):
        results = super().run(case, shards)
        if case.n_devices > 1 and case not in self.seen:
            results[0]["out"] = results[0]["out"] + 1
        self.seen.add(case)
        return results


def check(capsys, *args):
    """(exit status, stdout) of `python -m reference.testing check ARGS`."""
    status = main(["check", *args])
    return status, capsys.readouterr().out


def test_a_correct_ring_agrees_on_every_mask_and_dtype(capsys):
    status, out = check(capsys, "test_kit:ToyRing", "--world-sizes", "1,2,3", "--examples", "20", *FAST)
    assert status == 0, out
    assert re.match(r"toy ring agrees \(20 examples per world size, N = 1, 2, 3; line used: out [\d.e-]+, "
                    r"lse [\d.e-]+, dq [\d.e-]+, dk [\d.e-]+, dv [\d.e-]+; 1 is the line", out), out


def test_a_planted_window_bug_is_shrunk_with_a_command_that_replays_it(capsys, tmp_path):
    report = tmp_path / "verdict.md"
    status, out = check(capsys, "test_kit_cli:WINDOW_TOO_WIDE", "--world-sizes", "2,3", "--examples", "100",
                        "--masks", "causal,full,window", "--markdown", str(report), *FAST)
    assert status == 1, out
    lines = out.splitlines()
    assert lines[0].startswith("toy ring disagrees (N = 2, after "), out       # the smallest N first
    case = re.search(r"^  (Case\(.*\))$", out, re.M).group(1)
    assert "n_devices=2" in case and "S=2," in case and "window=1" in case and "Hq=1" in case, case
    assert re.search(r"^  out: 1 of \d+ elements out of tolerance; first at rank 1, global position 1 \(local \d\)",
                     out, re.M), out
    repro = lines[-1]
    assert repro.startswith("replay it: python -m reference.testing check test_kit_cli:WINDOW_TOO_WIDE --repro "), repro
    # the printed command, run, fails again with the same element
    argv = shlex.split(repro.removeprefix("replay it: python -m reference.testing "))
    status, again = check(capsys, *argv[1:])
    assert status == 1 and case in again and "first at rank 1, global position 1" in again, again
    text = report.read_text()
    assert "| 2 |" in text and "disagrees" in text and case in text and "--repro" in text, text


def test_a_ranks_document_offsets_wrong_is_found_from_the_command_line(capsys):
    status, out = check(capsys, "test_kit_cli:OFFSETS_WRONG", "--world-sizes", "2", "--layouts", "zigzag",
                        "--dtypes", "float64", "--examples", "100", *FAST)
    assert status == 1, out
    assert "cu_seqlens=(0, 4, 8)" in out and "first at rank 0, global position 7 (local 3)" in out, out


def test_bfloat16_cases_are_drawn_when_asked(capsys):
    status, out = check(capsys, "test_kit:ToyRing", "--world-sizes", "2", "--dtypes", "bfloat16", "--examples", "10",
                        "--masks", "causal,padding", *FAST)
    assert status == 0 and "agrees (10 examples" in out, out
    plan = make_plan(ToyRing(), dtypes=("bfloat16",), masks=("causal", "padding"))
    assert [np.dtype(d).name for d in plan.dtypes] == ["bfloat16"] and plan.masks == ("causal", "padding")


def test_shrinking_cut_short_is_a_verdict_on_the_smallest_case_so_far(capsys):
    """With --shrink-seconds spent, the kit still gives the smallest failure it found
    (hypothesis' last replay of it must fail again, or hypothesis calls the test flaky)."""
    status, out = check(capsys, "test_kit_cli:WINDOW_TOO_WIDE", "--world-sizes", "2", "--examples", "100",
                        "--masks", "causal,full,window", "--shrink-seconds", "0", *FAST)
    assert status == 1, out
    assert out.startswith("toy ring disagrees (N = 2, after ") and "in 0 s of shrinking (--shrink-seconds):" in out, out
    case = re.search(r"^  (Case\(.*\))$", out, re.M).group(1)
    assert "replay it: python -m reference.testing check test_kit_cli:WINDOW_TOO_WIDE --repro" in out, out
    assert check(capsys, "test_kit_cli:WINDOW_TOO_WIDE", "--repro", case)[0] == 1


def test_a_ring_that_disagrees_once_and_agrees_again_is_a_verdict(capsys):
    status, out = check(capsys, "test_kit_cli:WrongOnce", "--world-sizes", "1,2", "--examples", "20", *FAST)
    assert status == 1, out
    assert out.startswith("wrong-once ring disagrees, not every time (N = 2, after 0 agreeing examples there): "
                          "this case disagreed once and agreed when run again:"), out
    assert re.search(r"^  out: \d+ of \d+ elements out of tolerance; first at rank 0", out, re.M), out
    assert "replay it: python -m reference.testing check test_kit_cli:WrongOnce --repro" in out, out


def test_shapes_come_from_a_small_pool_while_masks_and_inputs_vary():
    """cases(shapes=3): at most 3 shapes per world size and layout, the smallest among them
    (where shrinking ends), those `keep` keeps; the masks, kinds, seeds still vary."""
    from hypothesis import given, settings
    drawn = []
    strategy = cases(dtypes=(np.float32,), devices=(2, 3), masks=("causal", "full", "window", "padding"),
                     shapes=3, keep=lambda case: case.Hq == case.Hkv)

    @settings(max_examples=150, database=None, derandomize=True)
    @given(strategy)
    def draw(case):
        drawn.append(case)

    draw()
    shape = lambda c: (c.B, c.S, c.Hq, c.Hkv, c.D, c.tile_size, c.scale)      # noqa: E731
    for n, layout in {(c.n_devices, c.layout) for c in drawn}:
        mine = [c for c in drawn if (c.n_devices, c.layout) == (n, layout)]
        assert 1 < len({shape(c) for c in mine}) <= 3, (n, layout, {shape(c) for c in mine})
    assert (1, 2, 1, 1, 1, None, None) in {shape(c) for c in drawn if c.n_devices == 2 and c.layout != "zigzag"}
    assert all(c.Hq == c.Hkv for c in drawn)
    for field in ("seed", "kind", "causal", "window"):
        assert len({getattr(c, field) for c in drawn}) > 1, field
    assert make_plan(ToyRing()).shapes == 0 and make_plan(ToyRing(), shapes=3).shapes == 3


def test_an_exception_in_the_ring_is_a_disagreement(capsys):
    status, out = check(capsys, "test_kit_cli:Raises", "--world-sizes", "1,2", "--examples", "20", *FAST)
    assert status == 1, out
    assert "raising ring raised on" in out and "ValueError: shapes do not match" in out, out
    assert "n_devices=2, B=1, S=2, Hq=1, Hkv=1, D=1," in out, out          # shrunk


def test_a_world_size_the_adapter_never_takes_is_said_and_not_counted(capsys):
    status, out = check(capsys, "test_kit_cli:NoSingleRank", "--world-sizes", "1,2", "--examples", "10", *FAST)
    assert status == 0 and re.match(r"toy ring agrees \(10 examples per world size, N = 2; .*; "
                                    r"N = 1 skipped: one rank: no ring; \d+ s\)", out), out
    status, out = check(capsys, "test_kit_cli:NoSingleRank", "--world-sizes", "1", *FAST)
    assert status == 2 and out.startswith("toy ring took none of the cases drawn; N = 1 skipped: one rank: no ring"), out


@pytest.mark.parametrize("args, words", [
    (["no_such_module:Ring"], "cannot import 'no_such_module'"),
    (["test_kit_cli"], "expected MODULE:ADAPTER"),
    (["test_kit_cli:Nothing"], "has no 'Nothing'"),
    (["test_kit_cli:check"], "is not an adapter: it has no name, layouts"),
    (["test_kit:ToyRing", "--dtypes", "float8"], "does not take dtype float8 (takes float64, float32, float16"),
    (["test_kit_cli:Raises", "--masks", "causal,window"], "does not take mask window (takes causal, full)"),
    (["test_kit:ToyRing", "--masks", "window"], "masks must take causal or full"),
    (["test_kit:ToyRing", "--world-sizes", "2,x"], "expected integers like 2,3,4"),
    (["test_kit:ToyRing", "--repro", "Case(layout="], "not a Case"),
    (["test_kit_cli:Raises", "--repro", "Case(layout='striped', n_devices=2, B=1, S=4, Hq=1, Hkv=1, D=1, "
      "tile_size=None, causal=True, scale=None, dtype=np.float64, kind='gaussian', seed=0, window=2)"],
     "does not take this case: mask window not supported"),
])
def test_usage_errors_exit_2_with_words(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        main(["check", *args])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_without_hypothesis_it_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)            # import hypothesis -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["check", "test_kit:ToyRing"])
    assert e.value.code == 2 and "pip install 'striped-attention[test]'" in capsys.readouterr().err


def test_an_adapter_is_an_object_or_a_class_made_without_arguments():
    assert isinstance(load_adapter("test_kit:ToyRing"), ToyRing)
    assert load_adapter("test_kit_cli:WINDOW_TOO_WIDE") is WINDOW_TOO_WIDE
    assert isinstance(load_adapter(f"{ROOT / 'tests' / 'kit' / 'test_kit.py'}:VarlenToyRing"), Adapter)


def test_progress_is_one_line_per_world_size_off_a_terminal():
    stream = io.StringIO()
    progress = Progress(stream)
    progress.update(2, 3, 10)                       # nothing: rewritten in place only on a terminal
    progress.done(2, 10)
    progress.done(3, 7, failed=True)
    assert re.fullmatch(r"  N = 2: 10 examples agree, \d+ s\n  N = 3: disagrees \(7 tries, shrinking included\), "
                        r"\d+ s\n", stream.getvalue()), stream.getvalue()


def test_the_module_runs_as_a_command(tmp_path):
    """The real entry point: help, then a planted bug's exit status 1 and the progress on stderr."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "kit")]))
    run = dict(cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    shown = subprocess.run([sys.executable, "-m", "reference.testing", "check", "--help"], **run)
    assert shown.returncode == 0 and "MODULE:ADAPTER" in shown.stdout and "Exit status: 0 agrees, 1 disagrees, 2 usage error" in shown.stdout
    failed = subprocess.run([sys.executable, "-m", "reference.testing", "check", "test_kit_cli:WINDOW_TOO_WIDE",
                             "--world-sizes", "2", "--examples", "50", "--masks", "causal,window"], **run)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "replay it: python -m reference.testing check" in failed.stdout
    assert re.search(r"N = 2: disagrees \(\d+ tries, shrinking included\)", failed.stderr), failed.stderr


def test_the_jax_harness_leaves_a_device_count_already_asked_for(monkeypatch):
    from reference.testing.harness import jax as harness
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=3")
    harness.request_devices()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=3"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    harness.request_devices(5)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=5"


def test_the_kit_imports_no_framework_and_no_hypothesis():
    code = ("import sys, os; import reference.testing, reference.testing.check, reference.testing.harness.jax\n"
            "print(sorted(m for m in ('jax', 'torch', 'hypothesis') if m in sys.modules), os.environ['XLA_FLAGS'])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert proc.stdout.split() == ["[]", "--xla_force_host_platform_device_count=8"], proc.stdout + proc.stderr


def test_the_readmes_jax_adapter_is_the_examples():
    """The kit's guide shows examples/jax_ring.py's adapter; it must not drift from the file that runs."""
    readme = (ROOT / "docs" / "kit.md").read_text()
    section = readme[readme.index("## A JAX ring"):]
    block = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    shown = block[block.index("def visible_keys"):]
    source = (ROOT / "examples" / "jax_ring.py").read_text()
    assert shown.replace("      # shard.q (B, c, Hq, D), shard.k, shard.v, shard.positions (c,)", "") in source
