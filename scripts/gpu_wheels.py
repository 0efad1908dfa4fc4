"""make gpu-wheels: every wheel `make gpu-check` needs on a GPU machine without a package index, in one folder.

    python scripts/gpu_wheels.py                                   # Python 3.12, manylinux x86-64 -> .gpu-wheels/
    python scripts/gpu_wheels.py --python-version 3.11 --dest DIR  # this machine's Python (the dry run)
    bash scripts/gpu_check.sh --wheels .gpu-wheels                 # then, on the GPU machine

Run it where pip reaches an index. The GPU machine this prepares for has Python
3.12, CuPy, torch, jax (so NumPy and ml_dtypes), mpi4py and nvcc, but no MPI
library, no mpiexec and no index. pip downloads binary wheels only, for that
Python and manylinux x86-64, of what the check imports or launches:

- the project's own dependencies ([project] dependencies in pyproject.toml);
- the `mpi` extra: mpich (libmpi.so.12 and mpiexec) and mpi4py (a known
  version, which finds that libmpi);
- the `test` extra, less matplotlib (no GPU test draws);
- pip itself, run from its wheel where the machine's Python has none.

It writes DEST/forced.txt (mpich and mpi4py: installed even where the machine
has a version, whose MPI library it lacks) and DEST/requirements.txt (the rest:
installed only where missing), which scripts/gpu_check.sh reads, and fails if
the folder is larger than what the device machine's carry takes (64 MiB).
"""

import argparse
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".gpu-wheels"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")      # pip matches these tags one by one
FORCED = ("mpich", "mpi4py")                # the machine's mpi4py may have no MPI library to load
LEFT_OUT = ("matplotlib",)                  # in the test extra for the plotting tests; no GPU test draws
EXTRAS = ("mpi", "test")
CARRY_LIMIT = 64 * 2**20


def requirement_name(requirement):
    """'hypothesis>=6.100' -> 'hypothesis'."""
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].strip()
    return requirement.strip()


def requirements(pyproject=ROOT / "pyproject.toml"):
    """(forced, others): the requirements the GPU check needs, from pyproject.toml."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    wanted = [r for r in dict.fromkeys(wanted) if requirement_name(r).lower() not in LEFT_OUT]
    forced = [r for r in wanted if requirement_name(r).lower() in FORCED]
    return forced, [r for r in wanted if r not in forced]


def download(dest, python_version, reqs):
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + list(reqs), check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python scripts/gpu_wheels.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(DEST), help="the folder (emptied first; default: %(default)s)")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: %(default)s)")
    args = ap.parse_args(argv)
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    forced, others = requirements()
    print(f"downloading wheels for Python {args.python_version}, manylinux x86-64, into {dest}:\n  "
          + " ".join(forced + others), flush=True)
    download(dest, args.python_version, forced + others + ["pip"])      # pip: not installed, run from its wheel
    (dest / "forced.txt").write_text("\n".join(forced) + "\n")
    (dest / "requirements.txt").write_text("\n".join(others) + "\n")
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.1f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {dest}")
    if size > CARRY_LIMIT:
        print(f"error: more than {CARRY_LIMIT // 2**20} MiB, which is all a device machine's carry takes",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
