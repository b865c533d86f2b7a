"""ctest's entry to the Python module's tests (tests/CMakeLists.txt): runs the pytest files
here, or executes a notebook, with PYTHONPATH pointing at the built package.

    run.py --built ON|OFF --pythonpath DIR pytest [pytest args...]
    run.py --built ON|OFF --pythonpath DIR notebook NOTEBOOK.ipynb OUTDIR
    run.py --built ON|OFF --pythonpath DIR script SCRIPT.py [args...]

Exits 77 (ctest's skip) with a message when the module was not built or the interpreter
lacks pytest / nbclient; otherwise the tests', the notebook's or the script's status.
"""

import argparse
import json
import os
import subprocess
import sys
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))


def skip(msg):
    print(f"SKIPPED: {msg}")
    sys.exit(SKIP)


def run_cells(notebook):
    """Executes a notebook's code cells in order in this interpreter (one namespace, as a
    kernel would); 0 when every cell ran, 1 at the first that raised."""
    import traceback
    import types
    try:
        import IPython.display  # noqa: F401
    except ImportError:
        ipy = types.ModuleType("IPython")
        disp = types.ModuleType("IPython.display")
        disp.HTML = str
        disp.display = print
        ipy.display = disp
        sys.modules["IPython"], sys.modules["IPython.display"] = ipy, disp
    with open(notebook, encoding="utf-8") as f:
        cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    ns = {"__name__": "__main__"}
    start = time.time()
    for i, cell in enumerate(cells):
        code = "".join(cell["source"])
        try:
            exec(compile(code, f"<cell {i}>", "exec"), ns)
        except Exception:
            traceback.print_exc()
            print(f"cell {i} raised:\n{code}")
            return 1
    print(f"{len(cells)} code cells ran without error ({time.time() - start:.1f} s)")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--built", required=True)
    ap.add_argument("--pythonpath", required=True)
    ap.add_argument("mode", choices=["pytest", "notebook", "script", "cells"])
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.built.upper() not in ("ON", "TRUE", "1"):
        skip("the Python module tally was not built (CMake found no pybind11, no Python 3 "
             "development files or no interpreter with numpy: see the 'Tally Python module' "
             "line of cmake's output; .ci/deps installs pybind11-dev python3-dev python3-numpy)")
    env = dict(os.environ)
    env["PYTHONPATH"] = a.pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # ipykernel's debugger note
    if a.mode == "pytest":
        try:
            import pytest  # noqa: F401
        except ImportError:
            skip(f"{sys.executable} has no pytest (Debian: python3-pytest)")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", HERE] + a.rest
        sys.exit(subprocess.call(cmd, env=env, cwd=HERE))
    if a.mode == "cells":
        sys.exit(run_cells(a.rest[0]))
    if a.mode == "script":
        sys.exit(subprocess.call([sys.executable] + a.rest, env=env, cwd=HERE))
    notebook, outdir = a.rest[0], a.rest[1]
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError:
        # No Jupyter here (the GPU machine's image): the cells run in order in a child
        # interpreter, IPython's display stubbed when IPython is missing too.
        print(f"{sys.executable} has no nbclient/nbformat: running the code cells directly")
        os.makedirs(outdir, exist_ok=True)
        cmd = [sys.executable, os.path.join(HERE, "run.py"), "--built", "ON", "--pythonpath",
               a.pythonpath, "cells", notebook, outdir]
        sys.exit(subprocess.call(cmd, env=env, cwd=outdir))
    os.makedirs(outdir, exist_ok=True)
    # The kernel is this interpreter (the one the module was built for), whatever the
    # notebook's metadata names: a kernel spec of its own, found through JUPYTER_PATH.
    spec_dir = os.path.join(outdir, "jupyter", "kernels", "tally-python")
    os.makedirs(spec_dir, exist_ok=True)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "Tally (Python 3)", "language": "python"}, f)
    env["JUPYTER_PATH"] = os.path.join(outdir, "jupyter") + os.pathsep + env.get("JUPYTER_PATH", "")
    os.environ.update(env)  # the kernel inherits PYTHONPATH
    nb = nbformat.read(notebook, as_version=4)
    start = time.time()
    client = NotebookClient(nb, timeout=300, kernel_name="tally-python",
                            resources={"metadata": {"path": outdir}})
    try:
        client.execute()
    finally:
        out = os.path.join(outdir, os.path.basename(notebook))
        nbformat.write(nb, out)
        print(f"executed notebook written to {out} ({time.time() - start:.1f} s)")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    if errors:
        for e in errors:
            print(f"{e['ename']}: {e['evalue']}")
        sys.exit(1)
    print(f"{sum(c.cell_type == 'code' for c in nb.cells)} code cells ran without error")


if __name__ == "__main__":
    main()
