"""ctest python_pip_install: `pip install .` and `pip wheel .` from the checkout, offline
(--no-build-isolation --no-index, Debian's python3-setuptools and python3-wheel), into a fresh
virtual environment (--system-site-packages: numpy and pytest come from the system), then
Python tests run against the installed copy from outside the source tree, without PYTHONPATH.

    pip_install.py --built ON|OFF --source DIR --build-dir DIR --work DIR

The CMake build folder of the test run is reused (TALLY_BUILD_DIR: setup.py builds its targets
tally_python, ab_memory and tally_memdiff there, which ctest's build already did), so the
install costs seconds, not a second build of the library. Exits 77 (ctest's skip) with a
message when the module was not built or the interpreter lacks venv, setuptools or wheel.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import zipfile

SKIP = 77
TESTS = ("test_torch_names.py", "test_call_sites.py", "test_tensor.py")


def skip(msg):
    print(f"SKIPPED: {msg}")
    sys.exit(SKIP)


def run(cmd, **kw):
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--built", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    if a.built.upper() not in ("ON", "TRUE", "1"):
        skip("the Python module tally was not built (see the 'Tally Python module' line of "
             "cmake's output)")
    for mod, pkg in (("venv", "python3-venv"), ("ensurepip", "python3-venv"),
                     ("setuptools", "python3-setuptools"), ("wheel", "python3-wheel"),
                     ("pytest", "python3-pytest")):
        try:
            __import__(mod)
        except ImportError:
            skip(f"{sys.executable} has no {mod} (Debian: {pkg})")

    work = os.path.abspath(a.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    venv = os.path.join(work, "venv")
    run([sys.executable, "-m", "venv", "--system-site-packages", venv])
    py = os.path.join(venv, "bin", "python")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CMAKE_ARGS")}
    env["TALLY_BUILD_DIR"] = os.path.abspath(a.build_dir)
    env["TALLY_SETUPTOOLS_BUILD"] = os.path.join(work, "setuptools")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    pip = [py, "-m", "pip", "--no-cache-dir"]
    offline = ["--no-build-isolation", "--no-index"]

    # The README's command: pip install . (from the checkout).
    run(pip + ["install", *offline, a.source], env=env, cwd=work)
    # A wheel holds the extension, the package's Python files and the two programs, runnable.
    wheels = os.path.join(work, "wheels")
    run(pip + ["wheel", *offline, "--no-deps", "-w", wheels, a.source], env=env, cwd=work)
    [whl] = glob.glob(os.path.join(wheels, "tally-*.whl"))
    with zipfile.ZipFile(whl) as z:
        names = {i.filename: i for i in z.infolist()}
    for need in ("tally/__init__.py", "tally/_torch.py", "tally/ab.py", "tally/ab_memory",
                 "tally/tally_memdiff"):
        assert need in names, f"{whl} lacks {need}: {sorted(names)}"
    assert [n for n in names if n.startswith("tally/_C.") and n.endswith(".so")], sorted(names)
    for tool in ("tally/ab_memory", "tally/tally_memdiff"):
        assert (names[tool].external_attr >> 16) & 0o111, f"{tool} is not executable in {whl}"

    # The installed copy, from outside the checkout, without PYTHONPATH.
    check = ("import os, sys, tally\n"
             "pkg = os.path.dirname(tally.__file__)\n"
             "assert pkg.startswith(sys.prefix), (pkg, sys.prefix)\n"
             "assert tally.ab.program() == os.path.join(pkg, 'ab_memory'), tally.ab.program()\n"
             "x = tally.nn.Linear(4, 2)(tally.randn(3, 4))\n"
             "print('installed tally', tally.__version__, 'at', pkg, '| ab_memory:', tally.ab.program())\n")
    run([py, "-c", check], env=env, cwd=work)
    here = os.path.dirname(os.path.abspath(__file__))
    env["TALLY_TEST_TMP"] = os.path.join(work, "tmp")
    run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[os.path.join(here, t) for t in TESTS]],
        env=env, cwd=work)
    print("pip install, pip wheel and the installed copy's tests passed")


if __name__ == "__main__":
    main()
