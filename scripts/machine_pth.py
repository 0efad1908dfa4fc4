"""Write the .pth that lets a fresh venv see the packages of the interpreter running this.

    python scripts/machine_pth.py VENV_SITE_PACKAGES

scripts/gpu_check.sh runs it with the machine's interpreter. The .pth is one
import line, run when the venv's Python starts: it adds the interpreter's
prefixes to `site.PREFIXES`, so that `site.getsitepackages()` lists its
site-packages (CuPy finds NVRTC and cuBLAS through cuda-pathfinder, which
searches there, not `sys.path`), and adds each of its package folders with
`site.addsitedir`, after the venv's, so that the .pth files in them are read too.
"""

import argparse
import os
import site
import sys


def pth_line(prefixes, folders):
    # site runs the line with exec in a function's locals: no comprehension sees `site` there
    return "import site; site.PREFIXES.extend(%r); list(map(site.addsitedir, %r))" % (list(prefixes), list(folders))


def main(target):
    folders = [p for p in dict.fromkeys(site.getsitepackages() + sys.path)
               if os.path.isdir(p) and p.endswith(("site-packages", "dist-packages"))]
    prefixes = list(dict.fromkeys([sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]))
    with open(os.path.join(target, "machine-packages.pth"), "w") as f:
        f.write(pth_line(prefixes, folders) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python scripts/machine_pth.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", metavar="VENV_SITE_PACKAGES", help="the venv's site-packages folder, to write the .pth into")
    main(ap.parse_args().target)
