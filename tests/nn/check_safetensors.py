#!/usr/bin/env python3
"""Reads a safetensors file with the Python standard library only (struct + json) and
checks that it is well formed: an 8-byte little-endian header length, a JSON header whose
entries have a known dtype, a shape and data_offsets that match the dtype and shape, and
data offsets that tile the data section exactly (what the Rust/Python safetensors
readers require).

Usage:
  check_safetensors.py FILE [--expect MANIFEST.json]
      MANIFEST: {"name": {"shape": [..], "sum": s, "first": x}, ...}; every tensor must be
      present with that shape, the sum of its values and its first value (tolerance 1e-3
      relative, for the 16-bit floats).
  check_safetensors.py --dump EQUIVALENCE_DUMP_EXE
      Runs `EXE --model gpt-tiny --device cpu --out TMP` and checks the three files it
      writes (weights, batch, grads: grads named like the weights plus "loss").

Exit 0 when all checks pass, 1 on a failure, 2 on bad usage or an unreadable file.
The module also exports read_safetensors(path) -> (tensors, metadata) with tensors
{name: (dtype, shape, bytes)}, and values(dtype, bytes) -> list of floats.
"""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U8": 1, "BOOL": 1}
STRUCT_CODES = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i", "I16": "h",
                "I8": "b", "U8": "B", "BOOL": "?"}


class FormatError(Exception):
    pass


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise FormatError(f"{path}: {len(raw)} bytes, shorter than the header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise FormatError(f"{path}: header length {n} exceeds the file")
    try:
        header = json.loads(raw[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not JSON: {e}")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not an object")
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {}) or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    tensors = {}
    spans = []
    for name, e in header.items():
        for key in ("dtype", "shape", "data_offsets"):
            if key not in e:
                raise FormatError(f"{path}: tensor {name!r} lacks {key}")
        dtype, shape, (b, end) = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"{path}: tensor {name!r}: unknown dtype {dtype}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise FormatError(f"{path}: tensor {name!r}: bad shape {shape}")
        numel = math.prod(shape)
        if end - b != numel * DTYPE_SIZES[dtype]:
            raise FormatError(f"{path}: tensor {name!r}: {end - b} bytes for {dtype} {shape}")
        spans.append((b, end, name))
        tensors[name] = (dtype, list(shape), data[b:end])
    pos = 0
    for b, end, name in sorted(spans):
        if b != pos:
            raise FormatError(f"{path}: tensor {name!r} starts at {b}, expected {pos} (hole or overlap)")
        pos = end
    if pos != len(data):
        raise FormatError(f"{path}: data section is {len(data)} bytes, tensors cover {pos}")
    return tensors, metadata


def values(dtype, buf):
    if dtype == "BF16":
        halves = struct.unpack(f"<{len(buf) // 2}H", buf)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    code = STRUCT_CODES[dtype]
    n = len(buf) // DTYPE_SIZES[dtype]
    return [float(v) for v in struct.unpack(f"<{n}{code}", buf)]


failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def close(a, b):
    return abs(a - b) <= 1e-3 * max(1.0, abs(b))


def check_file(path, manifest=None):
    tensors, metadata = read_safetensors(path)
    print(f"{path}: {len(tensors)} tensors, metadata {metadata}")
    for name, (dtype, shape, buf) in tensors.items():
        vals = values(dtype, buf)
        print(f"  {name:40s} {dtype:5s} {str(shape):20s} sum={sum(vals):.6g}")
    if manifest:
        for name, exp in manifest.items():
            if not check(name in tensors, f"{name} missing"):
                continue
            dtype, shape, buf = tensors[name]
            vals = values(dtype, buf)
            check(shape == exp["shape"], f"{name}: shape {shape} != {exp['shape']}")
            check(close(sum(vals), exp["sum"]), f"{name}: sum {sum(vals)} != {exp['sum']}")
            if vals:
                check(close(vals[0], exp["first"]), f"{name}: first {vals[0]} != {exp['first']}")
        check(set(manifest) == set(tensors), f"names differ: {sorted(set(manifest) ^ set(tensors))}")
    return tensors


def check_dump(exe):
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([exe, "--model", "gpt-tiny", "--device", "cpu", "--out", out],
                           capture_output=True, text=True)
        if not check(r.returncode == 0, f"{exe} failed: {r.stdout}{r.stderr}"):
            return
        weights = check_file(os.path.join(out, "weights.safetensors"))
        batch = check_file(os.path.join(out, "batch.safetensors"))
        grads = check_file(os.path.join(out, "grads.safetensors"))
        check("input" in batch and "target" in batch, "batch lacks input/target")
        check("loss" in grads, "grads lack the loss")
        for name, (dtype, shape, _) in grads.items():
            if name == "loss":
                continue
            if check(name in weights, f"grad {name} has no weight"):
                check(weights[name][1] == shape, f"grad {name}: shape {shape} != {weights[name][1]}")
        check("lm_head.weight" in weights and "transformer.wte.weight" in weights, "tied names missing")
        check("transformer.h.0.attn.c_attn.weight" in grads, "c_attn grad missing")
        loss = values(grads["loss"][0], grads["loss"][2])[0]
        check(4.0 < loss < 7.0, f"gpt-tiny initial loss {loss} not near ln(256)")


def main(argv):
    try:
        if len(argv) == 2 and argv[0] == "--dump":
            check_dump(argv[1])
        elif len(argv) == 1:
            check_file(argv[0])
        elif len(argv) == 3 and argv[1] == "--expect":
            with open(argv[2]) as f:
                check_file(argv[0], json.load(f))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (OSError, FormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for m in failures:
        print("FAIL:", m, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
