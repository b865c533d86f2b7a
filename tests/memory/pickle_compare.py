#!/usr/bin/env python3
"""Test helper for test_pickle.cpp: load pickles written by PickleWriter and compare.

Usage:
  pickle_compare.py value PICKLE EXPECTED_PY
      PICKLE holds one pickle. EXPECTED_PY is Python code run with `v` bound to the loaded
      value; it must set `expected`, and may assert more (e.g. `v[0] is v[1]` for memo
      sharing). `v` must equal `expected` strictly: same types (True is not 1, 1.0 is not
      1), same float bits (-0.0, nan), same dict key order.
  pickle_compare.py cpython PICKLE EXPECTED_PY
      PICKLE holds several pickles back to back; `expected` is the list of their values;
      each pickle must be byte-identical to CPython's pickle.dumps(value, protocol=2).

Every pickle must also pass check_snapshot.py's byte checks (PROTO 2, the viewer's opcode
subset, MARK batches <= 1000). Exit 0 on success, 1 with a message on mismatch.
"""

import io
import math
import os
import pickle
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_snapshot  # noqa: E402


def strict_diff(a, b, path="v"):
    """None if a and b are strictly equal, else a description of the first difference."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} ({a!r:.80}) != {type(b).__name__} ({b!r:.80})"
    if isinstance(a, float):
        same = (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
        return None if same else f"{path}: {a!r} != {b!r}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = strict_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {list(a)!r:.200} != {list(b)!r:.200}"
        for k in a:
            d = strict_diff(a[k], b[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r:.200} != {b!r:.200}"


def check_bytes(data, label):
    c = check_snapshot.Checker(tally=True)
    c.check_bytes(data)
    if c.errors:
        sys.exit(f"{label}: " + "; ".join(c.errors))


def main():
    mode, pickle_path, expected_path = sys.argv[1:4]
    with open(pickle_path, "rb") as f:
        data = f.read()
    with open(expected_path, encoding="utf-8") as f:
        code = f.read()

    if mode == "value":
        check_bytes(data, pickle_path)
        stream = io.BytesIO(data)
        v = pickle.load(stream)
        if stream.read():
            sys.exit("bytes after STOP")
        scope = {"v": v, "math": math}
        exec(code, scope)  # noqa: S102 - test expectations written by the test itself
        d = strict_diff(v, scope["expected"])
        if d:
            sys.exit(f"mismatch at {d}")
    elif mode == "cpython":
        scope = {"math": math}
        exec(code, scope)  # noqa: S102
        expected = scope["expected"]
        stream = io.BytesIO(data)
        for i, want in enumerate(expected):
            start = stream.tell()
            v = pickle.load(stream)
            mine = data[start:stream.tell()]
            check_bytes(mine, f"pickle {i}")
            d = strict_diff(v, want, f"v{i}")
            if d:
                sys.exit(f"mismatch at {d}")
            theirs = pickle.dumps(want, protocol=2)
            if mine != theirs:
                sys.exit(f"pickle {i} ({want!r}): bytes {mine.hex(' ')} != CPython's "
                         f"{theirs.hex(' ')}")
        if stream.read():
            sys.exit(f"more pickles than the {len(expected)} expected")
    else:
        sys.exit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
