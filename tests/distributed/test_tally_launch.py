#!/usr/bin/env python3
"""tools/tally_launch without GPUs: torchrun's environment variables per rank, "[rankK] "
prefixes on stdout and stderr, NCCL_NVLS_ENABLE passed through untouched, and a failing
rank stopping the others with its exit status."""
import os
import subprocess
import sys
import time

launcher = sys.argv[1]


def run(n, script, env=None, timeout=60):
    return subprocess.run([sys.executable, launcher, "--nproc-per-node", str(n), "--master-port", "0",
                           "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ)


def check(cond, what, r=None):
    if not cond:
        print("FAIL:", what)
        if r is not None:
            print("stdout:\n" + r.stdout + "\nstderr:\n" + r.stderr)
        sys.exit(1)


env = dict(os.environ, NCCL_NVLS_ENABLE="0")
r = run(3, 'echo "env $RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT $NCCL_NVLS_ENABLE"; echo oops >&2', env)
check(r.returncode == 0, f"exit status {r.returncode}", r)
lines = sorted(l for l in r.stdout.splitlines() if " env " in l)
check(len(lines) == 3, "three ranks print", r)
ports = set()
for k, line in enumerate(lines):
    parts = line.split()
    check(parts[0] == f"[rank{k}]", f"prefix of {line!r}", r)
    check(parts[2:5] == [str(k), str(k), "3"], f"RANK/LOCAL_RANK/WORLD_SIZE in {line!r}", r)
    check(parts[5] == "127.0.0.1", "MASTER_ADDR", r)
    ports.add(parts[6])
    check(parts[7] == "0", "NCCL_NVLS_ENABLE passed through as 0", r)
check(len(ports) == 1 and 0 < int(ports.pop()) < 65536, "one MASTER_PORT for all", r)
check(sorted(l for l in r.stderr.splitlines() if "oops" in l) == [f"[rank{k}] oops" for k in range(3)],
      "stderr prefixed", r)

t0 = time.time()
r = run(3, 'if [ "$RANK" = 2 ]; then sleep 0.2; echo dying >&2; exit 5; fi; sleep 60; echo survived')
check(r.returncode == 5, f"a failing rank's status (got {r.returncode})", r)
check(time.time() - t0 < 30, "the other ranks were stopped", r)
check("survived" not in r.stdout, "no rank ran to the end", r)
check("rank 2" in r.stderr and "status 5" in r.stderr, "the launcher names the failing rank", r)

r = run(2, "exit 77")
check(r.returncode == 77, "a skip (77) propagates", r)

r = subprocess.run([sys.executable, launcher, "--nproc-per-node", "2", "/nonexistent/prog"], capture_output=True,
                   text=True, timeout=30)
check(r.returncode != 0 and "nonexistent" in r.stderr, "a missing program is a clear error", r)


def alive(pid):
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


# Issue 54: the launcher killed with SIGKILL (no handler runs) took its ranks with it (the
# parent-death signal each rank sets between fork and exec).
import signal
import tempfile
d = tempfile.mkdtemp(prefix="tally_launch_")
launcher_proc = subprocess.Popen([sys.executable, launcher, "--nproc-per-node", "2", "--master-port", "0",
                                  "sh", "-c", f'echo $$ > {d}/pid$RANK.tmp && mv {d}/pid$RANK.tmp {d}/pid$RANK; '
                                  "exec sleep 60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.time() + 20
while time.time() < deadline and not all(os.path.exists(f"{d}/pid{k}") for k in range(2)):
    time.sleep(0.05)
pids = [int(open(f"{d}/pid{k}").read()) for k in range(2) if os.path.exists(f"{d}/pid{k}")]
check(len(pids) == 2 and all(alive(p) for p in pids), f"two ranks run before the kill ({pids})")
launcher_proc.send_signal(signal.SIGKILL)
launcher_proc.wait()
deadline = time.time() + 10
while time.time() < deadline and any(alive(p) for p in pids):
    time.sleep(0.05)
left = [p for p in pids if alive(p)]
for p in left:
    os.kill(p, signal.SIGKILL)
check(not left, f"ranks {left} outlived their launcher (SIGKILL)")
print("tally_launch: OK")
