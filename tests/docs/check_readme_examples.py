#!/usr/bin/env python3
"""Run the README's printed CPU examples and check that they still print what the README shows.

Usage: check_readme_examples.py BUILD_DIR [MARKDOWN_FILE ...]   (default: README.md, docs/guide.md)

An example is a fenced block right after a line `<!-- check -->` (or `<!-- check exit=N -->`
for a command that exits with N; 0 otherwise). The block's first line is `$ COMMAND` (lines
ending in a backslash continue it); the lines after it are the expected output. The command
runs with bash in a fresh temporary folder where `build` is a link to BUILD_DIR, stdout and
stderr together, OMP_NUM_THREADS=1 unless set. Matching, line by line, trailing spaces ignored:

  * a line `...` skips any number of output lines (the output may end anywhere);
  * ` ... ` inside a line stands for any text;
  * `~` before a number (`~5.9 s`, `step ~+13%`) stands for any number: timings;
  * everything else must be equal.

Prints "FILE:LINE: message" with the first mismatch of each failing example and exits 1;
exits 0 with a summary line when all match; exits 77 (ctest's skip) when a program an example
runs is not built in BUILD_DIR (the sanitizer builds build only the unit tests); exits 2 on bad
usage. Standard library only.
"""

import os
import re
import subprocess
import sys
import tempfile
import time

CHECK = re.compile(r"^\s*<!--\s*check(?:\s+exit=(\d+))?\s*-->\s*$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
NUMBER = r"[-+\u2212\u00b1]?[\d.,]+"


def examples(path):
    """(line number, command, expected lines, exit code) of each checked block in `path`."""
    lines = open(path, encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = CHECK.match(lines[i])
        if not m:
            i += 1
            continue
        start = i + 1
        if start >= len(lines) or not FENCE.match(lines[start]):
            raise SystemExit(f"{path}:{i + 1}: `<!-- check -->` must come right before a fenced block")
        j = start + 1
        block = []
        while j < len(lines) and not FENCE.match(lines[j]):
            block.append(lines[j])
            j += 1
        if not block or not block[0].startswith("$ "):
            raise SystemExit(f"{path}:{start + 2}: a checked block starts with `$ COMMAND`")
        cmd = [block[0][2:]]
        k = 1
        while cmd[-1].rstrip().endswith("\\") and k < len(block):
            cmd.append(block[k])
            k += 1
        out.append((start + 2, "\n".join(cmd), block[k:], int(m.group(1) or 0)))
        i = j + 1
    return out


def line_pattern(expected):
    """A regex for one expected line: ` ... ` is any text, `~N` any number."""
    parts = re.split(r"( \.\.\. |~" + NUMBER + ")", expected.rstrip())
    rx = ""
    for p in parts:
        if p == " ... ":
            rx += " .* "
        elif p.startswith("~"):
            rx += NUMBER
        else:
            rx += re.escape(p)
    return re.compile(rx + r"\s*$")


def match(expected, actual):
    """None when `actual` (a list of lines) fits `expected`; else (expected index, message)."""

    def go(e, a):
        if e == len(expected):
            return None
        if expected[e].strip() == "...":
            if e + 1 == len(expected):
                return None
            best = None
            for skip in range(a, len(actual) + 1):
                r = go(e + 1, skip)
                if r is None:
                    return None
                if best is None or r[0] > best[0]:
                    best = r
            return best
        if a >= len(actual):
            return (e, f"expected `{expected[e]}`, the output ended")
        if not line_pattern(expected[e]).match(actual[a]):
            return (e, f"expected `{expected[e]}`\n    got      `{actual[a]}`")
        return go(e + 1, a + 1)

    return go(0, 0)


def main(argv):
    if len(argv) < 2 or not os.path.isdir(argv[1]):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    build = os.path.abspath(argv[1])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = argv[2:] or [os.path.join(root, "README.md"), os.path.join(root, "docs/guide.md")]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    found = [(path, ex) for path in files for ex in examples(path)]
    missing = sorted({p for _, ex in found for p in re.findall(r"\./build/(\S+)", ex[1])
                      if not os.path.isfile(os.path.join(build, p))})
    if missing:
        print(f"check_readme_examples: SKIP (not built in {build}: {', '.join(missing)})")
        return 77
    failures, count = [], 0
    for path, (line, cmd, expected, want_rc) in found:
        count += 1
        with tempfile.TemporaryDirectory(prefix="readme_example_") as work:
            os.symlink(build, os.path.join(work, "build"))
            t0 = time.monotonic()
            run = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, timeout=600)
            took = time.monotonic() - t0
        actual = run.stdout.decode("utf-8", "replace").splitlines()
        where = f"{os.path.relpath(path, root)}:{line}"
        if run.returncode != want_rc:
            tail = "\n".join(actual[-10:])
            failures.append(f"{where}: `{cmd}` exited {run.returncode}, not {want_rc}\n{tail}")
            continue
        r = match(expected, actual)
        if r is not None:
            at = f"{os.path.relpath(path, root)}:{line + len(cmd.splitlines()) + r[0]}"
            failures.append(f"{at}: `{cmd.splitlines()[0]}`: {r[1]}")
        else:
            print(f"ok  {where}  {took:.1f} s  {cmd.splitlines()[0]}")
    for f in failures:
        print(f)
    if failures:
        print(f"check_readme_examples: FAIL ({len(failures)} of {count} examples)")
        return 1
    if count == 0:
        print("check_readme_examples: FAIL (no `<!-- check -->` examples found)")
        return 1
    print(f"check_readme_examples: OK ({count} examples)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
