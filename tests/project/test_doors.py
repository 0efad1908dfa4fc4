"""Every door names its rooms, and says no more than a reader needs there
(docs/style.md, rule 23), read from the source with `ast`, nothing run:

- each package's ``__init__`` docstring lists every module and subpackage of
  the package, and nothing else, one line each, under a line ending "in reading
  order:" (``    dense         the formula, and `merge```);
- a module docstring is at most about 30 lines (a door's list of rooms not
  counted): the rest belongs in a guide in docs/.

The packages are pyproject.toml's and `bench`; the GPU package and the
conformance adapters are left out (`NOT_YET`) while they are rearranged.

    .venv/bin/python -m pytest tests/project/test_doors.py -q
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRA_PACKAGES = ("bench",)                  # packages of the repository that pyproject.toml does not install
HELD = ("reference", "mpi_impl", "model", "bench", "scripts", "examples", "tests")
NOT_YET = ("gpu_impl", "peers", "scripts/gpu_", "tests/gpu/", "tests/support/gpu/")
MAX_DOC_LINES = 30
HEADING = re.compile(r"in reading order:\s*$")
ROOM = re.compile(r"^ {2,}`?([A-Za-z_]\w*)(?:\.py|/)?`? {2,}\S")


def packages():
    """pyproject.toml's packages (and `EXTRA_PACKAGES`) that hold modules, as folders."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.findall(r'"([\w.]+)"', re.search(r"^packages\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1))
    folders = [ROOT.joinpath(*name.split(".")) for name in (*listed, *EXTRA_PACKAGES)]
    return [f for f in folders if (f / "__init__.py").exists() and not held_back(f / "__init__.py")]


def held_back(path):
    return str(path.relative_to(ROOT)).startswith(NOT_YET)


def rooms(folder):
    """What a door must name: the package's modules and its subpackages."""
    return sorted([p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
                  + [p.name for p in folder.iterdir() if (p / "__init__.py").exists()])


def named(docstring):
    """(names listed under the "in reading order:" line, the list's lines, a line that is not one room)."""
    lines = docstring.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if HEADING.search(line)), None)
    if start is None:
        return [], [], None
    names, listed = [], []
    for line in lines[start:]:
        if not line.strip():
            if names:
                break
            continue
        match = ROOM.match(line)
        if not match:
            return names, listed, line
        names.append(match.group(1))
        listed.append(line)
    return names, listed, None


def docstring(path):
    return ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""


def test_every_door_names_its_rooms_one_line_each():
    assert len(packages()) >= 7, [str(p) for p in packages()]
    for folder in packages():
        door = folder / "__init__.py"
        names, _, stray = named(docstring(door))
        where = door.relative_to(ROOT)
        assert names, f"{where}: no list of rooms under a line ending 'in reading order:'"
        assert stray is None, f"{where}: one line a room, got {stray!r}"
        assert len(names) == len(set(names)), f"{where}: a room named twice"
        missing, stale = sorted(set(rooms(folder)) - set(names)), sorted(set(names) - set(rooms(folder)))
        assert not missing and not stale, f"{where}: rooms not named {missing}, named but absent {stale}"


def test_module_docstrings_say_what_a_reader_needs_at_that_door():
    long = []
    for root in HELD:
        for path in sorted((ROOT / root).rglob("*.py")):
            if held_back(path) or ".venv" in path.parts:
                continue
            text = docstring(path)
            n = len(text.splitlines()) - (len(named(text)[1]) if path.name == "__init__.py" else 0)
            if n > MAX_DOC_LINES:
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"module docstrings over {MAX_DOC_LINES} lines (the rest belongs in docs/):\n" + "\n".join(long)


def test_the_rules_see_a_room_left_out_a_stale_one_and_a_room_on_two_lines():
    door = '"""A package.\n\nModules, in reading order:\n\n    a     the first\n    `b.py`  the second\n    c/    the third\n"""\n'
    assert named(ast.get_docstring(ast.parse(door), clean=False))[::2] == (["a", "b", "c"], None)
    two_lines = door.replace("the second\n", "the second,\n          wrapped\n")
    assert named(ast.get_docstring(ast.parse(two_lines), clean=False))[2].strip() == "wrapped"
    assert named("Modules: a, b, c")[0] == []
