"""train_model (examples/train_model.cpp) end to end, in a few seconds of CPU: three steps of the
LLaMA-style decoder with a finite validation loss, a dry run (--estimate) of its 7B preset, the
planner's choice for its 13B preset on an 80 GB card, and bad invocations exiting 2 with a message that names the flag, before any work.

    check_train_model.py PATH/TO/train_model
"""
import math
import re
import subprocess
import sys


def run(prog, *args):
    p = subprocess.run([prog, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def main(prog):
    failures = []

    def expect(cond, what, out=""):
        if not cond:
            failures.append(f"{what}\n{out}")

    rc, out, err = run(prog, "--model", "llama", "--steps", "3", "--batch", "2", "--log-every", "1")
    m = re.search(r"val loss ([0-9.naif]+)", out)
    expect(rc == 0 and m and math.isfinite(float(m.group(1))),
           f"llama --steps 3: rc {rc}", out + err)
    expect("llama tiny" in out and "step 3/3" in out, "llama --steps 3: progress", out)

    rc, out, err = run(prog, "--model", "llama", "--preset", "7b", "--batch", "1", "--amp", "bf16",
                       "--checkpoint", "blocks", "--estimate", "h200")
    m = re.search(r"peak allocated\s+([0-9.]+) GiB", out)
    # 7B parameters (25.1 GiB), AdamW's two moments (50.2 GiB) and the gradients: ~100 GiB.
    expect(rc == 0 and m and 75 < float(m.group(1)) < 140, f"llama 7b --estimate h200: rc {rc}",
           out + err)
    expect("6738.42 M parameters" in out, "llama 7b: parameter count", out)

    # The planner for a 13B on an 80 GB card and a 125 GiB host: AdamW's float32 moments
    # outgrow the host, so it takes AdamW8bit's state there (the one plan that fits).
    rc, out, err = run(prog, "--model", "llama", "--preset", "13b", "--batch", "2", "--amp", "bf16",
                       "--checkpoint", "auto", "--memory-budget", "75GiB", "--estimate", "h100",
                       "--host-memory", "125GiB", "--steps", "3")
    expect(rc == 0 and re.search(r"Chosen: checkpoint \S+, amp bfloat16, adamw8bit:cpu", out),
           f"llama 13b --checkpoint auto --memory-budget 75GiB --estimate h100: rc {rc}", out + err)
    # With AdamW on the host named, every plan's dry run runs out of the host: the error says so.
    rc, out, err = run(prog, "--model", "llama", "--preset", "13b", "--batch", "2", "--amp", "bf16",
                       "--checkpoint", "auto", "--memory-budget", "75GiB", "--estimate", "h100",
                       "--host-memory", "125GiB", "--optimizer", "adamw:cpu", "--steps", "3")
    expect(rc == 2 and "every plan's dry run ran out of memory" in err and "optimizer_state" in err,
           f"llama 13b --optimizer adamw:cpu --memory-budget 75GiB: rc {rc}", out + err)

    bad = [
        (["--model", "mycnn"], "'mycnn'"),
        (["--model", "llama", "--preset", "70b"], "'70b'"),
        (["--model", "llama", "--seq", "65"], "--seq 65"),
        (["--model", "llama", "--image-size", "32"], "--image-size"),
        (["--model", "resnet", "--seq", "16"], "--seq"),
        (["--model", "llama", "--optimizer", "rmsprop"], "--optimizer"),
        (["--model", "llama", "--checkpoint", "3-blocks"], "3-blocks"),
        ([], "--model"),
    ]
    for args, needle in bad:
        rc, out, err = run(prog, *args)
        expect(rc == 2 and needle in err and err.startswith("train_model: "),
               f"{' '.join(args)}: rc {rc}, expected exit 2 naming {needle!r}", out + err)

    for f in failures:
        print("FAIL:", f)
    print(f"{'PASS' if not failures else 'FAIL'}: train_model")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
