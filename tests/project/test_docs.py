"""The README's and the guides' examples run as written, so a page cannot drift from the code.

Every fenced ``python`` block and every command of a ``sh`` or ``bash`` block
of README.md, docs/*.md and notebooks/README.md runs, from an empty folder,
with this Python's folder (the venv's python and mpiexec) first on PATH, as
after ``. .venv/bin/activate``. Left out, each for a reason the page or this
module gives:

- a block after a ``<!-- not run here: why -->`` line (it needs torch, jax, a
  GPU or a cluster, or another test runs it);
- ``make`` commands (CI runs the targets) and the activation line itself.

A python block whose first line is ``# save as NAME.py, run: COMMAND`` is
saved in that folder and COMMAND runs; the other python blocks of a page run
in order in one process, as a reader pastes them.

    .venv/bin/python -m pytest tests/project/test_docs.py -q
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "README.md"]
NOT_RUN = "<!-- not run here:"
SAVE_AS = re.compile(r"# save as (\S+), run: (.+)")
SKIPPED = (re.compile(r"make\b"), re.compile(r"\. \.venv/bin/activate$"))
TIMEOUT_S = 300


def blocks(text):
    """[(language, code, run)] of the page's fenced blocks; `run` is False
    after a not-run line."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```") and line.strip() != "```":
            language = line[3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            run = not (i > 0 and lines[i - 1].startswith(NOT_RUN))
            found.append((language, "\n".join(lines[i + 1:end]) + "\n", run))
            i = end
        i += 1
    return found


def commands(code):
    """The commands of a shell block: continuation lines joined, comments and
    blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def examples():
    """pytest params: (page, kind, what) for every example to run."""
    params = []
    for page in PAGES:
        python = []
        for language, code, run in blocks(page.read_text()):
            if not run:
                continue
            if language == "python":
                saved = SAVE_AS.match(code.splitlines()[0])
                if saved:
                    params.append(pytest.param(page, "saved", code, id=f"{page.name}:{saved.group(1)}"))
                else:
                    python.append(code)
            elif language in ("sh", "bash"):
                for command in commands(code):
                    if not any(rule.match(command) for rule in SKIPPED):
                        short = command.split("  #")[0].strip()[:60]
                        params.append(pytest.param(page, "command", command, id=f"{page.name}:{short}"))
        if python:
            params.append(pytest.param(page, "python", "\n".join(python), id=f"{page.name}:python"))
    return params


def environment():
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=str(ROOT),
                MPIEXEC_TIMEOUT=str(TIMEOUT_S), MPLBACKEND="Agg")


def run(command, cwd):
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=TIMEOUT_S + 30)
    assert proc.returncode == 0, f"{command}\nexited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("page, kind, what", examples())
def test_the_pages_examples_run_as_written(page, kind, what, tmp_path):
    if kind == "command":
        run(what, tmp_path)
    elif kind == "saved":
        name, command = SAVE_AS.match(what.splitlines()[0]).groups()
        (tmp_path / name).write_text(what)
        run(command, tmp_path)
    else:
        (tmp_path / "page.py").write_text(what)
        run("python page.py", tmp_path)


def test_every_page_has_examples_and_says_why_it_leaves_one_out():
    """The parser sees each page's blocks (a change of fence would silently
    run nothing) and each block left out gives its reason."""
    for page in PAGES:
        text = page.read_text()
        fences = [line for line in text.splitlines() if line.startswith("```")]
        assert len(fences) % 2 == 0, f"{page.name}: a fence left open"
        assert len(blocks(text)) == sum(1 for f in fences[::2] if f.strip() != "```"), page.name
        for line in text.splitlines():
            if line.startswith(NOT_RUN):
                assert len(line) > len(NOT_RUN) + len(" -->") + 3, f"{page.name}: a block left out without why"
    ids = [p.id for p in examples()]
    assert any(i.startswith("README.md:python") for i in ids)
    assert any(i.startswith("README.md:mpiexec") for i in ids)
    assert any(i.startswith("mpi.md:my_ring.py") for i in ids)


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    text = path.read_text()
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_every_link_of_the_pages_reaches_its_file_and_heading():
    for page in PAGES + sorted((ROOT / "docs" / "notes").glob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            assert where.exists(), f"{page.name}: {target} does not exist"
            if anchor:
                assert anchor in anchors(where), f"{page.name}: no heading '{anchor}' in {where.name}"
