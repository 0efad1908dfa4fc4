"""A clone carries every document it cites (docs/style.md, rule 23): no file of
the repository points at a file the repository lacks.

A citation is, in any tracked text file but the executed notebooks (their
sources are read):

- a markdown link ``[text](path)`` of a page (``.md``) or a notebook's source,
  relative to the file;
- a path to a ``.md`` or ``.py`` file, backquoted or plain, whose first folder
  is one of the repository's (``tests/steps/test_step.py``) or one beside the
  citing file (``notes/x.md`` in docs/), or that starts with ``../``;
- a document's name alone, in capitals (``README.md``, ``BENCHMARKS.md``).

Left alone: other projects' files (``ring/utils.py``: no folder of ours first),
lower-case names alone (``my_ring.py``, a file a page asks the reader to write),
placeholders in capitals (``scripts/NAME.py``) and the files a make target
writes (the Makefile's ``-> path``).

    .venv/bin/python -m pytest tests/project/test_citations.py -q
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
PATH = re.compile(r"(?<![\w./~$@:-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*\.(?:md|py))(?![\w/])")
CAPITALS = re.compile(r"[A-Z][A-Z_]+\.md")
PLACEHOLDERS = ("NAME", "NN_")
NOT_TEXT = (".ipynb", ".png", ".csv", ".json")
# (file, citation) left as they are, each with why
LEFT = {("gpu_impl/kernels/attend_block_v1.cu", "tests/test_gpu.py"),   # the kernels' headers are being rewritten
        }


def tracked(root=ROOT):
    """The repository's text files, as git lists them (nothing built or installed)."""
    names = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    return [root / n for n in names.splitlines() if not n.endswith(NOT_TEXT) and (root / n).is_file()]


def written_by_make(root):
    """Files and folders the Makefile's comments say a target writes
    (``make bench ... -> BENCHMARKS.md and bench/results/``)."""
    makefile = root / "Makefile"
    text = makefile.read_text() if makefile.exists() else ""
    return [p for line in re.findall(r"->\s*(.+)", text) for p in re.findall(r"[\w.-]+(?:/[\w.-]*)+|[\w-]+\.\w+", line)]


def written(target, outputs):
    return any(target == out or (out.endswith("/") and target.startswith(out)) for out in outputs)


def citations(path, text, folders):
    """(line, target, folder it is relative to, or None for a name found anywhere) of each citation."""
    found = []
    page = path.suffix == ".md" or path.parent.name == "notebooks"
    for number, line in enumerate(text.splitlines(), 1):
        if page:
            found += [(number, t, path.parent) for t in LINK.findall(line) if not re.match(r"[a-z]+:", t)]
        for target in PATH.findall(line):
            first = target.split("/")[0]
            if "/" not in target:
                if CAPITALS.fullmatch(target):
                    found.append((number, target, None))
            elif (page if first == ".." else first in folders or (path.parent / first).is_dir()) \
                    and not any(p in target for p in PLACEHOLDERS):
                found.append((number, target, path.parent))
    return list(dict.fromkeys(found))        # a link's target is a path too: once


def missing(files, root=ROOT):
    """'file:line: target' for each citation, in `files`, of a file that `root` lacks."""
    folders = {p.relative_to(root).parts[0] for p in files if len(p.relative_to(root).parts) > 1}
    names = {p.name for p in files}
    outputs = written_by_make(root)
    bad = []
    for path in files:
        for number, target, beside in citations(path, path.read_text(errors="replace"), folders):
            if beside is None:
                ok = target in names or written(target, outputs)
            else:
                ok = (root / target).exists() or (beside / target).exists() or written(target, outputs)
            if not ok and (str(path.relative_to(root)), target) not in LEFT:
                bad.append(f"{path.relative_to(root)}:{number}: {target}")
    return bad


def test_no_file_cites_a_file_the_repository_lacks():
    bad = missing([p for p in tracked() if p != Path(__file__).resolve()])     # not this file's examples
    assert not bad, "citations of files the repository lacks:\n" + "\n".join(bad)


def test_each_kind_of_broken_citation_is_caught_and_nothing_else(tmp_path):
    files = {"README.md": "", "Makefile": "#   make check   writes -> CHECK.md and bench/results/\n",
             "docs/design.md": "", "docs/notes/a.md": "", "tests/steps/test_step.py": "", "ring.py": ""}
    broken = ["see [the rules](rules.md)", "`tests/test_gone.py`", "STYLE.md, rule 18", "docs/gone.md's share",
              "[up](../GONE.md)", "notes/gone.md", "../docs/gone.md"]
    fine = ["see [the rules](design.md#rows)", "`tests/steps/test_step.py`", "README.md", "notes/a.md",
            "ring/utils.py line 3", "save as my_ring.py", "`scripts/NAME.py`", "bench/results/check.md",
            "CHECK.md", "out = tmp_path / 'B.md'",
            "https://github.com/a/b/blob/main/docs/x.md", "(../README.md)", "`reference.testing`", "mpi4py"]
    files["docs/page.md"] = "\n".join(broken + fine) + "\n"
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = missing(sorted(tmp_path / n for n in files), root=tmp_path)
    assert [b.split(": ", 1)[1] for b in bad] == ["rules.md", "tests/test_gone.py", "STYLE.md", "docs/gone.md",
                                                  "../GONE.md", "notes/gone.md", "../docs/gone.md"], bad
