#!/usr/bin/env python3
"""A random walk over Tally's Python API: nothing may crash on odd arguments.

    api_walk.py SEED CALLS [SEED CALLS ...]

Each walk calls CALLS functions, methods and constructors picked at random (seeded) from the
`tally` module tree, with arguments drawn from the types in pybind11's signatures, a fifth of
them odd on purpose (negative or huge integers, NaN, empty or long strings, paths that cannot
be written, tensors of other shapes and dtypes, objects of the wrong type). Results are kept
and fed to later calls (a module built by one call is trained by the next). A call may raise
any ordinary exception with a message; it may not crash the interpreter, hang, or raise an
exception without a message. The walk runs in a child process (PYTHONHASHSEED=0), so a crash
is reported with the calls that led to it. CPU memory is capped at 1 GiB, so a huge tensor is
an out-of-memory error rather than a machine-sized allocation.
"""
import inspect
import os
import random
import re
import subprocess
import sys
import tempfile

SKIP = ("launch", "init_process_group", "set_per_process_memory_fraction", "set_num_threads",
        "DataLoader.__iter__", "_ab_memory_path", "tally.ab.", "._ab.")
CAP_BYTES = 1 << 30


def walk_api(tally):
    out, seen = [], set()

    def visit(mod, prefix):
        for name in sorted(dir(mod)):
            if name.startswith("__"):
                continue
            try:
                obj = getattr(mod, name)
            except Exception:
                continue
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if inspect.ismodule(obj) and obj.__name__.startswith("tally"):
                visit(obj, prefix + name + ".")
            elif inspect.isclass(obj):
                for m in sorted(dir(obj)):
                    if m.startswith("__") and m not in ("__init__", "__getitem__", "__setitem__",
                                                         "__call__", "__add__", "__mul__",
                                                         "__matmul__", "__iter__", "__len__",
                                                         "__repr__", "__truediv__"):
                        continue
                    try:
                        out.append((prefix + name + "." + m, obj, m, getattr(obj, m)))
                    except Exception:
                        pass
            elif callable(obj):
                out.append((prefix + name, None, name, obj))

    visit(tally, "tally.")
    return [f for f in out if not any(s in f[0] for s in SKIP)]


SIG = re.compile(r"^(?:\d+\. )?\w+\((.*)\) -> .*$")


def signatures(f):
    sigs = []
    for line in (getattr(f, "__doc__", None) or "").splitlines():
        m = SIG.match(line.strip())
        if not m:
            continue
        params, depth, cur = [], 0, ""
        for ch in m.group(1):
            if ch in "[(":
                depth += 1
            elif ch in "])":
                depth -= 1
            if ch == "," and depth == 0:
                params.append(cur.strip())
                cur = ""
            else:
                cur += ch
        if cur.strip():
            params.append(cur.strip())
        sig = []
        for p in params:
            if p.startswith("*"):
                sig.append((p, "*", False))
                continue
            name, _, rest = p.partition(":")
            typ, eq, _ = rest.partition("=")
            sig.append((name.strip(), typ.strip().replace("tally._C.", ""), bool(eq)))
        sigs.append(sig)
    return sigs


def child(seed, calls):
    import tally
    import tally._C as C

    page = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tally.memory.set_per_process_memory_fraction(min(1.0, CAP_BYTES / page), "cpu")
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="tally_api_walk_")
    tensors = []
    for shape in ([], [0], [3], [2, 3], [1, 2, 3, 4], [2, 0, 3], [4, 3, 5, 5], [2, 4, 8]):
        for dt in (C.float32, C.float16, C.bfloat16, C.int64, C.bool, C.float64, C.uint8):
            tensors.append(C.randn(shape).to(dt))
    objects = {}

    def odd():
        return rng.choice([None, -1, 0, 2**63 - 1, -2**63, float("nan"), float("inf"), "",
                           "x" * 1000, [], [-1], [2**40, 2**40], object(), rng.choice(tensors)])

    def value(typ, name):
        if rng.random() < 0.2:
            return odd()
        if typ.startswith("Optional["):
            if rng.random() < 0.3:
                return None
            typ = typ[9:-1]
        if typ == "int":
            return rng.choice([0, 1, 2, 3, -1, -2, 4, 7, 64, 2**31, 2**62])
        if typ == "float":
            return rng.choice([0.0, 0.1, 1.0, -1.0, 1e-8, 1e30, float("nan"), float("inf")])
        if typ == "bool":
            return rng.random() < 0.5
        if typ == "str":
            if "path" in name or "file" in name or name in ("f", "out", "filename"):
                return rng.choice([os.path.join(tmp, "a.bin"), "/nonexistent/x/y", tmp, "",
                                   os.path.join(tmp, "b.pickle")])
            return rng.choice(["cpu", "cuda", "meta", "mean", "sum", "none", "h200", "blocks",
                               "2-segments", "float16", "bf16", "channels_last", "activation",
                               "x", "", "expandable_segments:True", "1GiB", "relu", "weight"])
        if typ == "Tensor":
            return rng.choice(tensors)
        if typ == "dtype":
            return rng.choice([C.float32, C.float16, C.bfloat16, C.int64, C.bool, C.uint8])
        if "List[int]" in typ or "list[int]" in typ or "Sequence[SupportsInt]" in typ:
            return [rng.choice([0, 1, 2, 3, -1, 4, 2**33]) for _ in range(rng.randrange(5))]
        if "Tensor]" in typ:
            return [rng.choice(tensors) for _ in range(rng.randrange(4))]
        if typ == "memory_format":
            return rng.choice([C.channels_last, C.contiguous_format])
        for cls, kept in objects.items():
            if typ.endswith(cls) and kept:
                return rng.choice(kept)
        if typ == "object":
            return rng.choice([1, 2, (1, 2), [3, 3], "cpu", C.float32, rng.choice(tensors),
                               None, -1, (0, -1)])
        return odd()

    def keep(r):
        if r is None or isinstance(r, (int, float, str, bool, bytes, list, tuple, dict)):
            return
        kept = objects.setdefault(type(r).__name__, [])
        if len(kept) < 20:
            kept.append(r)
        else:
            kept[rng.randrange(20)] = r
        if isinstance(r, C.Tensor) and len(tensors) < 300:
            tensors.append(r)

    ordinary = (TypeError, ValueError, RuntimeError, IndexError, KeyError, OverflowError,
                NotImplementedError, OSError, AttributeError, MemoryError, StopIteration,
                ZeroDivisionError, C.UnpickleError, C.OutOfMemoryError)
    api = walk_api(tally)
    made = 0
    for i in range(calls):
        name, cls, method, f = rng.choice(api)
        sigs = signatures(f)
        if not sigs:
            continue
        sig = rng.choice(sigs)
        target = None
        if cls is not None and method != "__init__":
            if not objects.get(cls.__name__):
                continue
            target = rng.choice(objects[cls.__name__])
        args, kwargs = [], {}
        for pname, typ, has_default in sig:
            if pname == "self" or pname.startswith("**"):
                continue
            if typ == "*":
                args += [value("int", "x") for _ in range(rng.randrange(4))]
            elif not (has_default and rng.random() < 0.5):
                v = value(typ, pname)
                if has_default or rng.random() < 0.2:
                    kwargs[pname] = v
                else:
                    args.append(v)
        print(f"{i} {name} {[type(a).__name__ for a in args]} {sorted(kwargs)}", file=sys.stderr,
              flush=True)
        try:
            if method == "__init__":
                r = cls(*args, **kwargs)
            elif target is not None:
                r = getattr(target, method)(*args, **kwargs)
            else:
                r = f(*args, **kwargs)
            made += 1
            keep(r)
            if isinstance(r, (list, tuple)):
                for x in r[:3]:
                    keep(x)
        except ordinary as e:
            if not str(e):
                sys.exit(f"FAIL: {name} raised {type(e).__name__} without a message")
    print(f"seed {seed}: {calls} calls, {made} returned", flush=True)


def main():
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        return
    pairs = sys.argv[1:]
    for k in range(0, len(pairs), 2):
        seed, calls = pairs[k], pairs[k + 1]
        try:
            # String hashing pinned, so a set's order repeats from run to run. Checks against the
            # memory the system has free can still answer differently in two runs of a seed.
            p = subprocess.run([sys.executable, __file__, "--child", seed, calls],
                               capture_output=True, text=True, errors="replace", timeout=600,
                               env={**os.environ, "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired as e:
            log = (e.stderr or b"").decode(errors="replace").splitlines()[-10:]
            sys.exit("FAIL: seed {} hung (600 s); last calls:\n{}".format(seed, "\n".join(log)))
        if p.returncode != 0:
            log = "\n".join(p.stderr.splitlines()[-15:])
            sys.exit(f"FAIL: seed {seed} exited {p.returncode}; last calls and output:\n{log}\n"
                     f"{p.stdout[-2000:]}")
        print(p.stdout.strip())


if __name__ == "__main__":
    main()
