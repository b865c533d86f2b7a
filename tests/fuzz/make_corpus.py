#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets: small valid and near-valid inputs.

Usage: python3 tests/fuzz/make_corpus.py [OUT_DIR]   (default: tests/fuzz/corpus)

Each target's input layout is described at the top of tests/fuzz/fuzz_<name>.cpp. The seeds
are named seed-*; inputs the fuzzers found (regressions) are named after what they broke and
are never rewritten by this script. Stdlib only.
"""

import gzip
import json
import os
import struct
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def idx(dims, payload=None):
    n = 1
    for d in dims:
        n *= d
    head = bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims)
    return head + (payload if payload is not None else bytes(i % 10 for i in range(n)))


def gz(data):
    return gzip.compress(data, mtime=0)


# ---- idx: mode byte (0 plain, 1 raw bytes named .gz, 2 gzip'd by the harness, 3 MNIST) ----
labels = idx([5])
images = idx([3, 4, 4])
write("idx", "plain-labels", b"\x00" + labels)
write("idx", "plain-images", b"\x00" + images)
write("idx", "plain-rank4", b"\x00" + idx([2, 1, 2, 3]))
write("idx", "plain-empty-dims", b"\x00" + idx([0, 28, 28]))
write("idx", "plain-truncated", b"\x00" + images[:-5])
write("idx", "plain-bad-magic", b"\x00" + b"\x00\x00\x0d\x03" + images[4:])
write("idx", "plain-huge-dims", b"\x00" + bytes([0, 0, 8, 4]) + b"\xff\xff\xff\xff" * 4)
write("idx", "plain-wide-dims", b"\x00" + bytes([0, 0, 8, 3]) + struct.pack(">III", 1 << 20, 1 << 20, 1 << 20))
write("idx", "gz-valid-stream", b"\x01" + gz(images))
write("idx", "gz-truncated-stream", b"\x01" + gz(images)[:-9])
write("idx", "gz-not-gzip", b"\x01" + images)
write("idx", "packed-images", b"\x02" + images)
write("idx", "packed-truncated", b"\x02" + images[:-1])
write("idx", "mnist-valid", b"\x03" + struct.pack(">H", len(images)) + images + idx([3]))
write("idx", "mnist-count-mismatch", b"\x03" + struct.pack(">H", len(images)) + images + labels)
write("idx", "mnist-label-range", b"\x03" + struct.pack(">H", len(images)) + images + idx([3], b"\x01\x0a\x02"))
write("idx", "mnist-images-rank2", b"\x03" + struct.pack(">H", 4 + 8 + 6) + idx([2, 3]) + idx([2]))
write("idx", "mnist-zero-by-zero", b"\x03" + struct.pack(">H", 16) + idx([3, 0, 0]) + idx([3]))

# ---- cifar: mode byte (bit 0 train, bit 1 no data_batch_5); train: 5 big-endian lengths ----
REC = 1 + 3 * 32 * 32


def record(label, fill):
    return bytes([label]) + bytes((fill + i) % 256 for i in range(REC - 1))


two = record(3, 0) + record(9, 7)
write("cifar", "test-two", b"\x00" + two)
write("cifar", "test-one", b"\x00" + record(0, 1))
write("cifar", "test-bad-label", b"\x00" + record(10, 0))
write("cifar", "test-partial-record", b"\x00" + two[:-100])
write("cifar", "test-empty", b"\x00")
lengths = [REC, REC, 0, REC, REC]
write("cifar", "train-five", b"\x01" + b"".join(struct.pack(">H", n) for n in lengths)
      + record(1, 2) + record(2, 3) + record(4, 5) + record(5, 6))
write("cifar", "train-missing-last", b"\x03" + b"".join(struct.pack(">H", n) for n in [REC, 0, 0, 0, 0]) + record(1, 2))
write("cifar", "train-ragged", b"\x01" + b"".join(struct.pack(">H", n) for n in [REC + 1, REC - 1, 0, 0, 0])
      + record(1, 2) + record(2, 3))

# ---- text: val_fraction (double), seq_len, batch (int64), seed byte, then the corpus ----
def text(val, seq, batch, body, seed=1):
    return struct.pack("<dqqB", val, seq, batch, seed) + body


fortune = (b"A day for firm decisions!!!!!  Or is it?\n%\n"
           b"A few hours grace before the madness begins again.\n%\n")
write("text", "fortune", text(0.1, 8, 4, fortune))
write("text", "no-val", text(0.0, 4, 2, fortune))
write("text", "half", text(0.5, 16, 3, fortune))
write("text", "seq-too-long", text(0.1, 1000, 2, fortune))
write("text", "two-bytes", text(0.1, 1, 1, b"ab"))
write("text", "one-byte", text(0.1, 1, 1, b"a"))
write("text", "bad-fraction", text(1.0, 4, 2, fortune))
write("text", "zero-batch", text(0.1, 4, 0, fortune))
write("text", "binary", text(0.25, 3, 5, bytes(range(256))))

# ---- safetensors: mode byte (0 the whole file; 1 framed: 2-byte header length + header + data) ----
def safetensors(entries, metadata=None, pad=True):
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape, payload in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    return h, data


def whole(h, data):
    return b"\x00" + struct.pack("<Q", len(h)) + h + data


def framed(h, data):
    return b"\x01" + struct.pack(">H", len(h)) + h + data


basic = [("weight", "F32", [2, 3], struct.pack("<6f", *range(6))),
         ("bias", "F32", [3], struct.pack("<3f", 0.5, -1.0, 2.0)),
         ("step", "I64", [], struct.pack("<q", 7)),
         ("mask", "BOOL", [4], b"\x01\x00\x01\x01"),
         ("half", "F16", [2], b"\x00\x3c\x00\xc0"),
         ("brain", "BF16", [1, 2], b"\x80\x3f\x00\x40"),
         ("wide", "F64", [1], struct.pack("<d", 3.25)),
         ("idx", "I32", [2], struct.pack("<2i", -1, 5)),
         ("empty", "F32", [0, 4], b"")]
h, d = safetensors(basic, {"format": "pt", "note": "caf\u00e9 \"quoted\""})
write("safetensors", "all-dtypes", whole(h, d))
write("safetensors", "all-dtypes-framed", framed(h, d))
write("safetensors", "truncated-body", whole(h, d)[:-3])
h1, d1 = safetensors(basic[:2])
write("safetensors", "two-framed", framed(h1, d1))
write("safetensors", "empty-header", whole(b"{}", b""))
write("safetensors", "header-too-long", b"\x00" + struct.pack("<Q", 1 << 40) + b"{}")
write("safetensors", "escapes", framed(b'{"a\\u00e9\\ud83d\\ude00\\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
                                       b"\x00\x00\x80\x3f"))
write("safetensors", "overlap", framed(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                       b'"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}', b"\x00" * 8))
write("safetensors", "big-shape", framed(b'{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}', b""))
write("safetensors", "float-shape", framed(b'{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}', b"\x00" * 4))
write("safetensors", "nested", framed(b'{"__metadata__":{"k":"v"},"a":{"dtype":"I64","shape":[[1]],"data_offsets":[0,8]}}', b"\x00" * 8))
write("safetensors", "number-overflow", framed(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,1e400]}}', b"\x00" * 4))

# ---- alloc_conf: the setting, a NUL, then bytes that drive allocations ----
ops = bytes([0, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 12) + bytes(range(0, 256, 3))
for name, conf in [
        ("empty", b""),
        ("max-split", b"max_split_size_mb:128"),
        ("pytorch-example", b"max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.8"),
        ("divisions-intervals", b"roundup_power2_divisions:[64:8,256:4,>:1]"),
        ("divisions-first-gt", b"roundup_power2_divisions:[>:2]"),
        ("large-segments", b"large_segment_size_mb:4,max_non_split_rounding_mb:4"),
        ("compat-keys", b"expandable_segments:False, release_lock_on_cudamalloc:True,backend:native"),
        ("oom-snapshot", b"oom_snapshot:oom.pickle"),
        ("bad-key", b"max_split_size:128"),
        ("bad-value", b"garbage_collection_threshold:1.5"),
        ("huge-mib", b"max_split_size_mb:18446744073709551615"),
        ("unbalanced", b"roundup_power2_divisions:[64:8,,256:4"),
        ("expandable", b"expandable_segments:True"),
        ("expandable-mixed", b"expandable_segments:True,max_split_size_mb:32,large_segment_size_mb:4,garbage_collection_threshold:0.5"),
        ("expandable-bad-value", b"expandable_segments:yes"),
        ("expandable-reclaim", b"expandable_segments:True,reclaim_on_growth:True,large_segment_size_mb:2"),
        ("reclaim-alone", b"reclaim_on_growth:True"),
        ("duplicate-key", b"max_split_size_mb:64,max_split_size_mb:128"),
        ("divisions-2-63", b"roundup_power2_divisions:9223372036854775808"),
        ("divisions-duplicate-interval", b"roundup_power2_divisions:[64:8,64:4]"),
]:
    write("alloc_conf", name, conf + b"\x00" + ops)

# ---- checkpoint_spec: the spec ----
for name, spec in [("none", b"none"), ("off", b"off"), ("empty", b""), ("blocks", b"blocks"),
                   ("selective", b"selective"), ("1-segments", b"1-segments"), ("2-segments", b"2-segments"),
                   ("4-segments", b"4-segments"), ("int-max-segments", b"2147483647-segments"),
                   ("zero-segments", b"0-segments"), ("negative-segments", b"-1-segments"),
                   ("plus-segments", b"+2-segments"), ("space-segments", b" 2-segments"),
                   ("overflow-segments", b"99999999999-segments"), ("segment", b"3-segment")]:
    write("checkpoint_spec", name, spec)

# ---- specs: a byte choosing the parser (0 sizes, 1 offload, 2 category), then the text ----
for name, text in [("gib", b"6GiB"), ("mib", b"900MiB"), ("fraction", b"1.5GB"), ("plain", b"4096"),
                   ("past-2-53", b"9007199254740993"), ("max", b"9223372036854775807"),
                   ("over", b"9223372036854775808"), ("exponent", b"1e18"), ("hex", b"0x10GiB"),
                   ("negative", b"-1GiB"), ("space", b" 5 GiB"), ("nan", b"nan"), ("empty", b"")]:
    write("specs", "bytes-" + name, b"\x00" + text)
for name, text in [("none", b"none"), ("activations", b"activations"), ("6-blocks", b"6-blocks"),
                   ("zero-blocks", b"0-blocks"), ("long-blocks", b"1234567-blocks"), ("off", b"off")]:
    write("specs", "offload-" + name, b"\x01" + text)
for name in [b"activation", b"gradient", b"optimizer_state", b"offloaded", b"Activation"]:
    write("specs", "category-" + name.decode(), b"\x02" + name)

# ---- sizes: bytes a FuzzedDataProvider reads (integers from the end): pseudo-random starts of
# several lengths; the fuzzer finds the rest ----
rng = 12345
for i in range(12):
    data = bytearray()
    for _ in range(8 + 4 * i):
        rng = (rng * 1103515245 + 12345) % (1 << 31)
        data.append(rng >> 16 & 0xFF)
    write("sizes", "random-%02d" % i, bytes(data))

# ---- unpickle: the pickle (inspect/unpickle.h); small snapshots in Tally's layout and PyTorch's,
# Python's protocols 2-5, and broken ones ----
import pickle  # noqa: E402

FRAMES = [{"name": "linear", "filename": "nn/linear.cpp", "line": 42},
          {"name": "layer1.0", "filename": "module", "line": 0},
          {"name": "phase forward", "filename": "category=activation", "line": 0}]


def entry(action, addr, size, t, category="activation", module="layer1.0", op="linear", phase="forward"):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "compile_context": "N/A", "user_metadata": f"category={category} module={module} op={op} phase={phase}",
            "frames": FRAMES, "category": category}


tally_snapshot = {
    "segments": [{"device": 0, "address": 4096, "total_size": 2097152, "allocated_size": 512,
                  "active_size": 512, "requested_size": 400, "stream": 0, "segment_type": "small",
                  "segment_pool_id": (0, 0), "is_expandable": False, "frames": FRAMES,
                  "blocks": [{"address": 4096, "size": 512, "requested_size": 400, "state": "active_allocated",
                              "frames": FRAMES},
                             {"address": 4608, "size": 2096640, "requested_size": 0, "state": "inactive",
                              "frames": []}]}],
    "device_traces": [[entry("segment_alloc", 4096, 2097152, 1, "unknown"), entry("alloc", 8192, 1000, 2),
                       entry("free_requested", 8192, 1000, 3), entry("free_completed", 8192, 1000, 3),
                       entry("alloc", 8192, 1000, 3, "temporary"), entry("free_completed", 4096, 400, 5)]],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1},
    "external_annotations": [],
}
torch_frames = [{"name": "empty_cuda", "filename": "??", "line": 0},
                {"name": "forward", "filename": "torch/nn/modules/linear.py", "line": 125},
                {"name": "work", "filename": "exp.py", "line": 7}]
torch_snapshot = {"segments": [], "device_traces": [[
    {"action": "alloc", "addr": 1 << 40, "size": 2 ** 33, "stream": 0, "time_us": 10, "frames": torch_frames},
    {"action": "free_requested", "addr": 1 << 40, "size": 2 ** 33, "stream": 0, "time_us": 11, "frames": torch_frames},
    {"action": "free_completed", "addr": 1 << 40, "size": 2 ** 33, "stream": 0, "time_us": 12, "frames": torch_frames},
    {"action": "oom", "device_free": 0, "size": 2 ** 34, "stream": 0, "time_us": 13, "frames": []}]]}
for proto in (2, 4, 5):
    write("unpickle", f"tally-snapshot-p{proto}", pickle.dumps(tally_snapshot, protocol=proto))
    write("unpickle", f"torch-snapshot-p{proto}", pickle.dumps(torch_snapshot, protocol=proto))
two_devices = dict(torch_snapshot, device_traces=[[], torch_snapshot["device_traces"][0]])
write("unpickle", "two-devices", pickle.dumps(two_devices, protocol=4))
write("unpickle", "values-p3", pickle.dumps({"b": b"x", "t": (1, 2, 3), "f": -0.0, "n": None, "i": -2 ** 63}, protocol=3))
write("unpickle", "int", pickle.dumps(5, protocol=4))
write("unpickle", "truncated", pickle.dumps(tally_snapshot, protocol=2)[:300])
write("unpickle", "recursive", b"\x80\x02]q\x00h\x00a.")
write("unpickle", "global", b"\x80\x02cos\nsystem\n.")
