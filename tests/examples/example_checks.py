"""What the end-to-end tests of the example programs share: the program's run (its output
printed, the test stopped when it fails: there is nothing to check then) and a list of the
failed checks, which each test reports at its end."""
import subprocess
import sys

fails = []


def check(cond, msg):
    if not cond:
        fails.append(msg)
        print("FAIL:", msg)


def run_program(cmd, name, timeout):
    """Runs cmd and prints its stdout and stderr; exits 1 when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(p.stdout)
    print(p.stderr, file=sys.stderr)
    if p.returncode != 0:
        print(f"{name} failed with exit", p.returncode)
        sys.exit(1)
    return p
