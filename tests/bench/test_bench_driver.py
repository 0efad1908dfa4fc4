"""The bench driver (`bench.run`) rewrites the sections it runs and keeps the
others byte for byte: a section kept through any number of runs gains
nothing (not a blank line), and a section that carries its own title has it
once. Sections here are stand-in modules, instant.

    .venv/bin/python -m pytest tests/bench/test_bench_driver.py -q
"""

import importlib.machinery
import sys
import types

import pytest

from bench import run as bench_run

SECTIONS = {"first": ("bench_fake_first", "First section"),
            "titled": ("bench_fake_titled", "A section with its own title"),
            "last": ("bench_fake_last", "Last section")}


def _section(monkeypatch, name, text, pngs=()):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.run = lambda quick=True: (text, list(pngs))
    monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def sections(monkeypatch):
    monkeypatch.setattr(bench_run, "SECTIONS", SECTIONS)
    _section(monkeypatch, "bench_fake_first", "| a | b |\n| - | - |\n| 1 | 2 |\n")
    _section(monkeypatch, "bench_fake_titled", "## A section with its own title\n\nIts words.\n\n| x |\n| - |\n| 3 |\n")
    _section(monkeypatch, "bench_fake_last", "\nlast words\n\n")


def test_sections_kept_through_many_runs_stay_byte_for_byte(sections, tmp_path):
    out = tmp_path / "B.md"
    assert bench_run.main(["--out", str(out)]) == 0
    kept = bench_run.read_sections(out)
    assert set(kept) == set(SECTIONS)
    for _ in range(3):
        assert bench_run.main(["--only", "titled", "--out", str(out)]) == 0
        again = bench_run.read_sections(out)
        assert again["first"] == kept["first"] and again["last"] == kept["last"]
    text = out.read_text()
    assert "\n\n\n" not in text, text
    assert text.endswith(kept["last"]) and not text.endswith("\n\n")


def test_a_section_that_carries_its_title_has_it_once(sections, tmp_path):
    out = tmp_path / "B.md"
    assert bench_run.main(["--out", str(out)]) == 0
    assert bench_run.main(["--only", "first", "--out", str(out)]) == 0     # the titled one kept
    text = out.read_text()
    assert text.count("## A section with its own title") == 1
    assert text.count("## First section") == 1 and text.count("## Last section") == 1
    titled = bench_run.read_sections(out)["titled"]
    assert titled.startswith("## A section with its own title\n\nIts words.\n")


@pytest.mark.parametrize("option, value, words", [("--out", "{tmp}", "is a folder; give a file name"),
                                                  ("--results", "{tmp}/B.md", "is a file, not a folder"),
                                                  ("--only", "nope", "invalid choice")])
def test_the_driver_refuses_its_bad_options_before_running_a_section(sections, tmp_path, monkeypatch, capsys,
                                                                     option, value, words):
    (tmp_path / "B.md").write_text("")
    monkeypatch.setattr(bench_run, "run_section", lambda *a, **k: pytest.fail("a section ran"))
    with pytest.raises(SystemExit) as stop:
        bench_run.main([option, value.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument {option}" in err and words in err, err
