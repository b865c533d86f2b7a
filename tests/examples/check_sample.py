#!/usr/bin/env python3
"""train_gpt's --sample prints text a terminal can show.

    check_sample.py TRAIN_GPT
GPT-2's vocabulary (50,304) is larger than the text's 256 byte tokens: the sample must come
from the byte tokens only (before, a token >= 256 was cut to its low byte), and what it prints
must be UTF-8 without control characters other than line breaks and tabs (an untrained
model's bytes are neither).
"""
import subprocess
import sys

cmd = [sys.argv[1], "--preset", "gpt2", "--steps", "1", "--batch", "1", "--seq", "16",
       "--eval-batches", "1", "--sample", "64"]
p = subprocess.run(cmd, capture_output=True)
out = p.stdout + p.stderr
if p.returncode != 0:
    sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}:\n{out.decode(errors='replace')}")
try:
    text = out.decode("utf-8", errors="strict")
except UnicodeDecodeError as e:
    sys.exit(f"FAIL: the output is not UTF-8: {e}")
start, end = text.find("--- sample ---\n"), text.rfind("\n--------------")
if start < 0 or end < start:
    sys.exit(f"FAIL: no sample in the output:\n{text}")
sample = text[start + len("--- sample ---\n"):end]
bad = [c for c in sample if (ord(c) < 0x20 and c not in "\n\t") or ord(c) == 0x7F]
if bad:
    sys.exit(f"FAIL: control characters {bad!r} in the sample {sample!r}")
if not sample.startswith("Q:") or len(sample) < 2 + 64 // 4:
    sys.exit(f"FAIL: the sample {sample!r} does not start with the prompt 'Q:' and 64 bytes")
print(f"ok: {sample!r}")
