#!/usr/bin/env python3
"""The layer rules of docs/architecture.md, checked on every build.

Usage: check_layers.py REPO_ROOT [--back-arrows]. Exits 1, naming file:line and the rule, when
  - a source file includes a header of a layer above its own (base < memory < tensor+autograd
    < nn < optim; memory < inspect; inspect, tensor+autograd < profiler; nn < distributed;
    optim, profiler < ab);
  - a file of the tensor layer outside an op family's autograd.{h,cpp} includes autograd/
    (the op families' differentiable wrappers are the tensor layer's only way up; Tensor's
    autograd methods are declared in tensor/tensor.h and defined in
    autograd/tensor_methods.cpp, the one named exception, which needs no include);
  - a file of an op family folder (tensor/<family>/) other than its CUDA files (cuda.*,
    cuda_*) spells the CUDA build switch: backend #ifdefs stand only in backend files and
    the registration point (tensor/backends.cpp, via TALLY_CUDA_TABLE);
  - a file of the backend infrastructure (tensor/cpu/, tensor/cuda/) includes anything of the
    tensor layer but tensor/cpu/, tensor/cuda/ and the core headers (BACKEND_CORE): no op
    family, no dispatch, no op_alloc, no umbrella;
  - an include inside tensor/ points from a lower level to a higher one (a back-arrow; the
    levels are TENSOR_LEVELS: core < backends < plumbing < families < registration);
  - a C++ file of the library or of examples/ opens a file for writing itself (std::ofstream,
    std::fstream, fopen with "w"/"a"/"+", open with O_WRONLY/O_RDWR/O_CREAT): every writer goes
    through base/atomic_file.h (write_file_atomic), so a write cut short never destroys the
    previous file.
"""
import os
import re
import sys

ALLOWED = {
    "base": {"base"},
    "memory": {"base", "memory"},
    "inspect": {"base", "memory", "inspect"},
    "tensor": {"base", "memory", "tensor", "autograd"},
    "autograd": {"base", "memory", "tensor", "autograd"},
    "nn": {"base", "memory", "tensor", "autograd", "nn"},
    "optim": {"base", "memory", "tensor", "autograd", "nn", "optim"},
    "profiler": {"base", "memory", "inspect", "tensor", "autograd", "profiler"},
    "distributed": {"base", "memory", "tensor", "autograd", "nn", "distributed"},
    "ab": {"base", "memory", "inspect", "tensor", "autograd", "nn", "optim", "profiler", "ab"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')
EXTS = (".h", ".cpp", ".cu", ".cuh")
FAMILY_CORE = {"cpu", "cuda"}  # tensor/cpu, tensor/cuda: backend infrastructure, not families

# What tensor/cpu/ and tensor/cuda/ may include from the tensor layer besides themselves.
BACKEND_CORE = {"tensor/tensor.h", "tensor/dtype.h", "tensor/storage.h"}

# The levels inside tensor/, lowest first; an include may point to its own level or below.
# Keys are paths relative to tensor/ (a folder ends in "/"); any other folder is an op family.
CORE, BACKEND, PLUMBING, FAMILY, REGISTRATION = range(5)
TENSOR_LEVELS = {
    "tensor.": CORE, "dtype.": CORE, "storage.": CORE, "random.": CORE,
    "cpu/": BACKEND, "cuda/": BACKEND,
    "graph.cpp": BACKEND,  # tensor/cuda/graph.h's definitions (built without CUDA too)
    "dispatch.": PLUMBING, "op_alloc.": PLUMBING, "meta/": PLUMBING,
    "pinned.": FAMILY,  # to_device_async and the offload copies: ops of their own
    "host_link.": FAMILY,  # the host link's measured speed (on pinned's copies)
    "precision.": REGISTRATION,  # the process-wide precision switches of several families
    "backends.cpp": REGISTRATION, "ops.h": REGISTRATION,
}


# Back-arrows that stay, each with its reason; any other one fails the build.
KNOWN_BACK_ARROWS = {
    # Half converts through the branch-free float16 routines the CPU loops vectorize.
    ("tensor/dtype.h", "tensor/cpu/convert.h"),
    # A CUDA block freed while a stream still uses it is recorded on that stream.
    ("tensor/storage.cpp", "tensor/cuda/runtime.h"),
}


def tensor_level(rel):
    """The level of a path under tensor/ (relative to the repository)."""
    sub = rel[len("tensor/"):]
    for key, level in TENSOR_LEVELS.items():
        if sub.startswith(key):
            return level
    return FAMILY


def back_arrows(root, include_known=False):
    """The includes inside tensor/ from a lower level to a higher one (the known ones too
    when include_known)."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, "tensor")):
        for f in sorted(files):
            if not f.endswith(EXTS):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    m = re.match(r'^\s*#\s*include\s+"(tensor/[^"]+)"', line)
                    if (m and tensor_level(m.group(1)) > tensor_level(rel)
                            and (include_known or (rel, m.group(1)) not in KNOWN_BACK_ARROWS)):
                        out.append(f"{rel}:{n}: includes {m.group(1)} (a level above)")
    return out


def check(root):
    errors = []
    for layer, allowed in ALLOWED.items():
        base = os.path.join(root, layer)
        for dirpath, _, files in os.walk(base):
            for f in sorted(files):
                if not f.endswith(EXTS):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                parts = rel.split(os.sep)
                family = (layer == "tensor" and len(parts) == 3 and parts[1] not in FAMILY_CORE)
                stem = f.split(".")[0]
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for n, line in enumerate(fh, 1):
                        m = INCLUDE.match(line)
                        if m:
                            target = m.group(1)
                            if target in ALLOWED and target not in allowed:
                                errors.append(f"{rel}:{n}: the {layer} layer includes {target}/ "
                                              f"(allowed: {', '.join(sorted(allowed))})")
                            if (layer == "tensor" and target == "autograd"
                                    and not (family and stem == "autograd")):
                                errors.append(f"{rel}:{n}: only an op family's autograd.h/.cpp "
                                              "may include autograd/ from tensor/")
                        full = re.match(r'^\s*#\s*include\s+"(tensor/[^"]+)"', line)
                        if (layer == "tensor" and len(parts) >= 3 and parts[1] in FAMILY_CORE
                                and full and not full.group(1).startswith(("tensor/cpu/",
                                                                           "tensor/cuda/"))
                                and full.group(1) not in BACKEND_CORE):
                            errors.append(f"{rel}:{n}: backend infrastructure includes "
                                          f"{full.group(1)} (allowed from tensor/: cpu/, cuda/, "
                                          f"{', '.join(sorted(BACKEND_CORE))})")
                        if (family and "TALLY_WITH_CUDA" in line
                                and not (stem == "cuda" or stem.startswith("cuda_"))):
                            errors.append(f"{rel}:{n}: a backend #ifdef in an op family's "
                                          "shared file (register through tensor/backends.cpp)")
    return errors


# Opening a file for writing, outside base/atomic_file.cpp (the one place that does).
WRITE_OPEN = re.compile(r'\b(?:std::)?o?fstream\b|\bfopen\s*\([^;]*"[^"]*[wa+][^"]*"'
                        r'|\bO_(?:WRONLY|RDWR|CREAT)\b|\bcreat\s*\(')
WRITE_DIRS = ("base", "memory", "inspect", "tensor", "autograd", "nn", "optim", "profiler", "distributed",
              "ab", "examples")
ATOMIC_WRITER = os.path.join("base", "atomic_file.cpp")


def check_writes(root):
    errors = []
    for top in WRITE_DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(EXTS):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                if rel == ATOMIC_WRITER:
                    continue
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for n, line in enumerate(fh, 1):
                        code = line.split("//", 1)[0]
                        if not code.lstrip().startswith("#") and WRITE_OPEN.search(code):
                            errors.append(f"{rel}:{n}: opens a file for writing; write through "
                                          "base/atomic_file.h (write_file_atomic)")
    return errors


def main():
    if len(sys.argv) not in (2, 3):
        print("usage: check_layers.py REPO_ROOT [--back-arrows]", file=sys.stderr)
        return 2
    if len(sys.argv) == 3 and sys.argv[2] == "--back-arrows":
        arrows = back_arrows(sys.argv[1], include_known=True)
        for a in arrows:
            print(a)
        print(f"{len(arrows)} back-arrows inside tensor/")
        return 0
    errors = check(sys.argv[1]) + [f"back-arrow: {a}" for a in back_arrows(sys.argv[1])]
    for e in errors:
        print(f"layer rule: {e}", file=sys.stderr)
    write_errors = check_writes(sys.argv[1])
    for e in write_errors:
        print(f"write rule: {e}", file=sys.stderr)
    return 1 if errors or write_errors else 0


if __name__ == "__main__":
    sys.exit(main())
