"""The setuptools backend of `pip install .` (pyproject.toml): build_ext configures CMake in
TALLY_BUILD_DIR (default build-pip/ in the checkout) with the tests and benchmarks off, builds
the targets tally_python, ab_memory and tally_memdiff, and copies the extension and the two
programs into the package, where tally.ab looks first. CMAKE_ARGS (split like a shell line)
reaches CMake; the interpreter running pip is the one the module is built for."""

import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
TOOLS = ("ab_memory", "tally_memdiff")
SETUPTOOLS_DIR = os.path.relpath(os.environ.get("TALLY_SETUPTOOLS_BUILD")
                                 or os.path.join(ROOT, "build-pip", "setuptools"), ROOT)
os.makedirs(os.path.join(ROOT, SETUPTOOLS_DIR), exist_ok=True)


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        m = re.search(r"project\(tally VERSION ([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("setup.py: no `project(tally VERSION x.y.z)` in CMakeLists.txt")
    return m.group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        given = os.environ.get("TALLY_BUILD_DIR")
        build_dir = os.path.abspath(given or os.path.join(ROOT, "build-pip"))
        user_args = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        # A build folder of the user's own (TALLY_BUILD_DIR, already configured) is built as it
        # is configured; the default one is configured here, tests and benchmarks off.
        if given and os.path.isfile(os.path.join(build_dir, "CMakeCache.txt")) and not user_args:
            self._build(build_dir)
            self._copy(build_dir, ext)
            return
        args = ["-DCMAKE_BUILD_TYPE=Release", "-DTALLY_BUILD_TESTS=OFF",
                "-DTALLY_BUILD_BENCH=OFF", "-DTALLY_BUILD_EXAMPLES=ON",
                "-DTALLY_BUILD_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"]
        if not any(a.startswith("-Dpybind11_DIR") for a in user_args):
            try:  # pybind11 as a Python package (pip's, or an image's); else CMake's search
                import pybind11
                args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
            except ImportError:
                pass
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            args += ["-G", "Ninja"]
        if shutil.which("ccache") and not any("COMPILER_LAUNCHER" in a for a in user_args):
            args += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        subprocess.run(["cmake", "-S", ROOT, "-B", build_dir, *args, *user_args], check=True)
        self._build(build_dir)
        self._copy(build_dir, ext)

    @staticmethod
    def _build(build_dir):
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", build_dir, "--parallel", jobs, "--target",
                        "tally_python", *TOOLS], check=True)

    def _copy(self, build_dir, ext):
        built = os.path.join(build_dir, "python", "tally")
        exts = [f for f in os.listdir(built) if f.startswith("_C.") and f.endswith((".so", ".pyd"))]
        if len(exts) != 1:
            raise RuntimeError(f"setup.py: expected one extension _C.* in {built}, found {exts} "
                               "(CMake's output above says why the module was not built)")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(built, exts[0]), target)
        for tool in TOOLS:  # tally.ab finds them next to the package
            src = os.path.join(build_dir, "examples", tool)
            if not os.path.isfile(src):
                found = [os.path.join(d, tool) for d, _, files in os.walk(build_dir) if tool in files]
                if not found:
                    raise RuntimeError(f"setup.py: CMake built no {tool} under {build_dir}")
                src = found[0]
            shutil.copy2(src, os.path.join(os.path.dirname(target), tool))


setup(
    version=version(),
    packages=["tally"],
    package_dir={"tally": "python/tally"},
    ext_modules=[Extension("tally._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own folders stay out of the CMake build folder build/ and the package sources.
    options={"build": {"build_base": os.path.join(SETUPTOOLS_DIR, "build")},
             "egg_info": {"egg_base": SETUPTOOLS_DIR}},
    zip_safe=False,
)
