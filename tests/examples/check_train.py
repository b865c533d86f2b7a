#!/usr/bin/env python3
"""Runs a training program and checks a number it prints against a bound.

    check_train.py REGEX OP BOUND -- COMMAND...
REGEX has one group (a float) searched in the output; OP is ">=" or "<=". Fails with the
program's output when it exits non-zero, the number is missing, or the bound is not met.
"""
import re
import subprocess
import sys
import time

regex, op, bound = sys.argv[1], sys.argv[2], float(sys.argv[3])
cmd = sys.argv[sys.argv.index("--") + 1:]
t0 = time.time()
p = subprocess.run(cmd, capture_output=True, text=True)
out = p.stdout + p.stderr
print(out[-6000:])
print(f"({time.time() - t0:.0f} s)")
if p.returncode != 0:
    print(f"FAIL: {' '.join(cmd)} exited {p.returncode}")
    sys.exit(1)
m = re.findall(regex, out)
if not m:
    print(f"FAIL: /{regex}/ not found in the output")
    sys.exit(1)
v = float(m[-1])
ok = v >= bound if op == ">=" else v <= bound
print(f"{'ok' if ok else 'FAIL'}: {v} {op} {bound}")
sys.exit(0 if ok else 1)
