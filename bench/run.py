"""Run every benchmark section and write BENCHMARKS.md (tables) and bench/results/ (plots).

Each section is a module of `bench` with ``run(quick=True) -> (markdown, png_paths)``,
imported only when its turn comes. A section that is missing or raises is written into
the file as such and makes the exit status non-zero, except the GPU section on a
machine without a GPU. Progress goes to stderr, a line per step with the time elapsed.

    python -m bench.run                                  # quick: a few minutes on 2 cores
    python -m bench.run --full                           # the longer sweeps
    python -m bench.run --only paper predicted --out /tmp/B.md
"""

import argparse
import datetime
import importlib
import importlib.util
import inspect
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from reference import usage

from . import RESULTS, markdown_table
from .machine import blas_info, cpu_name, thread_settings

ROOT = Path(__file__).resolve().parents[1]

# name -> (module, title), in the order they are written
SECTIONS = {
    "paper": ("bench.paper", "The paper's Theoretical Maximum Speedup, recomputed"),
    "predicted": ("bench.predicted", "Predicted speed-up (cost model)"),
    "kernel": ("bench.kernel", "Kernel efficiency and memory of one device"),
    "mpi": ("bench.mpi_scaling", "Measured speed-up with MPI processes"),
    "schemes": ("bench.schemes", "The four schemes on MPI ranks against their cost model"),
    "nodes": ("bench.emulated_nodes", "Emulated nodes: the schemes and placements measured against the cost model"),
    "waits": ("bench.waits", "Waiting ranks: more ranks than cores, spinning against sleeping"),
    "overlap": ("bench.overlap", "Transfers hidden behind compute on MPI ranks"),
    "soak": ("bench.soak", "A soak: thousands of ring calls, memory and communicators flat"),
    "virtual": ("bench.virtual_ring", "Virtual devices: wall time against the total tile count"),
    "scale": ("bench.scale", "Long sequences on MPI ranks"),
    "model": ("bench.model_step", "The whole model: training-step speed-up on MPI ranks"),
    "masks": ("bench.masks", "Packed documents and sliding windows"),
    "gpu": ("bench.gpu_bench", "GPU"),
    "gpu_kernel": ("bench.gpu_kernel", "The tensor-core kernel, read before it runs"),
}
HEARTBEAT_S = 30     # a line on stderr this often while a long section runs
HEADLINES_MARK = "<!-- headlines: "      # a section's headline figures, under its footer


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="sections: " + ", ".join(f"{k} ({m})" for k, (m, _) in SECTIONS.items()))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help="small sizes, a few minutes on a 2-core laptop (default)")
    mode.add_argument("--full", dest="quick", action="store_false", help="the longer sweeps")
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), metavar="SECTION",
                    help="run only these sections (default: all)")
    ap.add_argument("--out", type=_markdown_file, default=str(ROOT / "BENCHMARKS.md"),
                    help="markdown file (default: BENCHMARKS.md in the repository root)")
    ap.add_argument("--results", type=usage.output_folder, default=str(RESULTS),
                    help="folder for plots, for sections that take one (default: bench/results)")
    return ap.parse_args(argv)


def _markdown_file(text):
    """--out: a file (its folder is made if missing), not a folder."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    return text


class Progress:
    """Lines on stderr: which section, elapsed time, and a heartbeat while one runs."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def say(self, msg):
        print(f"[bench {time.perf_counter() - self.t0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def beat_while(self, name):
        """Start a heartbeat thread; returns the function that stops it."""
        stop = threading.Event()
        started = time.perf_counter()

        def beat():
            while not stop.wait(HEARTBEAT_S):
                self.say(f"  {name} still running ({time.perf_counter() - started:.0f} s)")
        threading.Thread(target=beat, daemon=True).start()
        return stop.set


def has_gpu():
    """A CUDA device that CuPy can see (or, without CuPy, one the driver exposes)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:      # no CuPy, no driver, no device: all mean "no usable GPU"
        return Path("/dev/nvidia0").exists()


def git_commit():
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + (" with uncommitted changes" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(argv, quick, names):
    import numpy as np
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = shlex.join(["python", "-m", "bench.run", *argv])
    ran = ("every section" if len(names) == len(SECTIONS) else
           f"the sections {', '.join(names)}; the others as an earlier run wrote them (each footer says when and where)")
    return "\n".join([
        "# Benchmarks",
        "",
        f"Made by `make bench` (`python -m bench.run`; `--full` for the longer sweeps), from the repository "
        f"root; the last command was `{command}` ({'quick' if quick else 'full'} sizes), which ran {ran}. "
        "Rerunning changes the figures, never the sections. Timings are ratios measured side by side in one "
        "run (the machine may be shared and noisy); the cost model gives what each is held against. Dated "
        "investigations beyond these sections: [docs/notes/](docs/notes/).",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- machine: {cpu_name()}, {os.cpu_count()} cores ({usable} usable), {platform.system()} {platform.release()}",
        f"- BLAS: {blas_info()}",
        f"- numpy {np.__version__}, Python {platform.python_version()}",
        f"- thread settings: {thread_settings()}",
        f"- commit: {git_commit()}",
        "",
    ])


def run_section(name, quick, results_dir, progress):
    """(status, markdown, pngs, headlines): status is "ok", "missing" or
    "failed"; headlines, [(what, measured, goal)], where the section gives them
    (its run returns them third)."""
    module_name, _ = SECTIONS[name]
    if importlib.util.find_spec(module_name) is None:
        return "missing", f"**Not run: `{module_name}` does not exist in this checkout.**\n", [], []
    stop = progress.beat_while(name)
    try:
        run = importlib.import_module(module_name).run
        kwargs = {"quick": quick}
        params = inspect.signature(run).parameters
        if "results_dir" in params:
            kwargs["results_dir"] = results_dir
        if "progress" in params:
            kwargs["progress"] = lambda msg: progress.say(f"  {name}: {msg}")
        text, pngs, *headlines = run(**kwargs)
        return "ok", text, list(pngs), headlines[0] if headlines else []
    except (Exception, SystemExit):      # reported in the file and the exit status, not dropped
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        last = "\n".join(tb.strip().splitlines()[-12:])
        return "failed", f"**Failed: `{module_name}` raised.**\n\n```\n{last}\n```\n", [], []
    finally:
        stop()


def section_markdown(name, status, text, pngs, seconds, out_dir, headlines=()):
    """The section's text under its title, with its plots linked relative to
    the output file, and a footer saying when and where it ran (and its
    headlines, kept in a comment for the table at the top)."""
    title = SECTIONS[name][1]
    body = text.strip()
    parts = [body] if body.startswith("#") else [f"## {title}", body]
    for png in pngs:
        rel = os.path.relpath(Path(png).resolve(), out_dir)
        if Path(png).name not in body:      # the section may have linked it itself
            parts.append(f"![{Path(png).stem}]({Path(rel).as_posix()})")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    parts.append(f"*Section `{name}`: {status}, {seconds:.1f} s, {when}, {cpu_name()}.*"
                 + (f"\n{HEADLINES_MARK}{json.dumps([list(h) for h in headlines])} -->" if headlines else ""))
    return "\n\n".join(parts) + "\n"


def read_sections(path):
    """{name: its markdown} of the sections an earlier run wrote into `path`
    (none if it does not exist): from its title to its footer."""
    if not Path(path).exists():
        return {}
    text, found = Path(path).read_text(), {}
    for name, (_, title) in SECTIONS.items():
        start = text.find(f"\n## {title}\n")
        footer = text.find(f"*Section `{name}`:", start)
        if start < 0 or footer < 0:
            continue
        end = text.find("\n", footer)
        if text.startswith(HEADLINES_MARK, end + 1):
            end = text.find("\n", end + 1)
        found[name] = text[start + 1:end + 1 if end >= 0 else len(text)]
    return found


def summary(chunks):
    """The table of sections (status, seconds, when) and the headline table, read from the chunks' footers."""
    rows, heads = [], []
    for name, chunk in chunks.items():
        footer = re.search(rf"\*Section `{name}`: (.*), ([0-9.]+) s, ([0-9-]+), (.*)\.\*", chunk)
        status, seconds, when, _ = footer.groups() if footer else ("?", "?", "?", "?")
        rows.append((f"{name}: {SECTIONS[name][1]}", status, seconds, when))
        marked = re.search(re.escape(HEADLINES_MARK) + r"(.*) -->", chunk)
        for what, measured, goal in json.loads(marked.group(1)) if marked else ():
            anchor = re.sub(r"[^\w\- ]", "", SECTIONS[name][1].lower()).replace(" ", "-")
            heads.append((f"[{what}](#{anchor})", measured, goal, f"`python -m bench.run --only {name}`"))
    table = markdown_table(("what", "measured", "goal", "command"), heads, "lrll") if heads else ""
    return table, markdown_table(("section", "status", "seconds", "run on"), rows, "llrl")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    names = [n for n in SECTIONS if not args.only or n in args.only]     # in the file's order
    out = Path(args.out).resolve()
    progress = Progress()
    gpu = has_gpu()
    chunks, failures = read_sections(out) if args.only else {}, []
    for i, name in enumerate(names, 1):
        progress.say(f"[{i}/{len(names)}] {name} ({SECTIONS[name][0]}) ...")
        t0 = time.perf_counter()
        status, text, pngs, headlines = run_section(name, args.quick, args.results, progress)
        seconds = time.perf_counter() - t0
        if name == "gpu" and not gpu and status != "ok":
            text += "\nNo GPU on this machine: the GPU section is not required here.\n"
            status += " (no GPU: not required)"
        elif status != "ok":
            failures.append(f"{name} {status}")
        chunks[name] = section_markdown(name, status, text, pngs, seconds, out.parent, headlines)
        progress.say(f"[{i}/{len(names)}] {name}: {status} in {seconds:.1f} s")
    chunks = {name: chunks[name] for name in SECTIONS if name in chunks}
    headlines, contents = summary(chunks)
    out.parent.mkdir(parents=True, exist_ok=True)
    tables = [headlines, "", contents, ""] if headlines else [contents, ""]
    out.write_text("\n".join([header(argv, args.quick, names), *tables, *chunks.values()]))
    progress.say(f"wrote {out}" + (f"; problems: {', '.join(failures)}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
