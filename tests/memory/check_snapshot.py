#!/usr/bin/env python3
"""Check a memory snapshot pickle against the format PyTorch's memory tools read.

Usage: check_snapshot.py FILE [--expect-live N] [--pytorch] [--quiet]

Checks (docs/memory-formats.md §1, §2, §7):
  * bytes: PROTO 2 header (80 02), only the opcodes of §2, LONG1 <= 8 bytes, MARK batches
    of <= 1000 items, STOP at the end;
  * structure: keys and value types of the top-level dict, segments (§1.3), blocks (§1.4),
    trace entries (§1.5), frames (§1.6) and allocator_settings (§1.7);
  * segments: blocks tile each segment exactly in address order; allocated_size,
    active_size and requested_size agree with the blocks; segments do not overlap;
  * trace (per device): times do not go backwards; forward replay — `alloc` makes an
    address live, `free_completed` ends it, a `free_completed` with no earlier `alloc` was
    allocated before the trace window (as the viewer's "initially allocated") — must end
    with exactly the active blocks (allocated or pending-free) whose address the trace
    touched, with matching requested sizes and pending-free state; backward replay from
    `segments`, as the viewer's Allocator State History does, must find every freed or
    allocated block and every alloc's segment where it expects them (undoing an expandable
    segment's `segment_map` takes the pages out of their run, undoing `segment_unmap` puts
    them back, merged with the runs they touch);
  * Tally's extensions (§7, skipped with --pytorch): every entry has a lower-case
    `category` matching its `user_metadata` "category=… module=… op=… phase=…" and its
    frames; at least one entry is `unknown` when there are entries; active blocks and
    events have frames, inactive blocks none; identical frame lists are shared (memo).

--expect-live N: the snapshot must hold exactly N active_allocated blocks.
--pytorch: for snapshots written by PyTorch itself: accept PROTO 2-4 and its extra
  opcodes, entries without frames, and skip the Tally-only checks (§7, time units).

Prints one summary line and exits 0 when all checks pass; otherwise prints the failures
(at most 30) and exits 1. Exit 2: the file cannot be read or parsed. Stdlib only.
"""

import argparse
import collections
import pickle
import pickletools
import re
import sys

CATEGORIES = (
    "parameter", "gradient", "optimizer_state", "activation", "input", "temporary",
    "workspace", "autocast_cache", "communication", "offloaded", "unknown",
)
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
TALLY_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                 "snapshot", "oom", "segment_map", "segment_unmap")
PYTORCH_ACTIONS = TALLY_ACTIONS

# §2: the opcodes the viewer's JavaScript unpickler implements, and Tally writes.
ALLOWED_OPCODES = {
    "PROTO", "STOP", "NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "LONG1",
    "BINFLOAT", "BINUNICODE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE", "MARK", "APPENDS",
    "SETITEMS", "TUPLE2", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
}
# What PyTorch's own protocol-4 dumps add (accepted with --pytorch).
PYTORCH_EXTRA_OPCODES = {"FRAME", "SHORT_BINUNICODE", "MEMOIZE", "APPEND", "SETITEM", "TUPLE1",
                         "TUPLE3", "TUPLE"}
MAX_BATCH = 1000

SEGMENT_KEYS = {
    "device": int, "address": int, "total_size": int, "allocated_size": int,
    "active_size": int, "requested_size": int, "stream": int, "segment_type": str,
    "segment_pool_id": tuple, "is_expandable": bool, "frames": list, "blocks": list,
}
BLOCK_KEYS = {"address": int, "size": int, "requested_size": int, "state": str, "frames": list}
ENTRY_COMMON_KEYS = {"action": str, "size": int, "stream": int, "time_us": int,
                     "compile_context": str, "user_metadata": str, "frames": list}
FRAME_KEYS = {"name": str, "filename": str, "line": int}
FRAME_OPTIONAL_KEYS = {"fx_node_op", "fx_node_name", "fx_node_target", "fx_original_trace"}
SETTINGS_KEYS = {
    "PYTORCH_CUDA_ALLOC_CONF": str, "max_split_size": int, "garbage_collection_threshold": float,
    "expandable_segments": bool, "release_lock_on_cudamalloc": bool,
    "pinned_use_cuda_host_register": bool, "graph_capture_record_stream_reuse": bool,
    "pinned_num_register_threads": int, "roundup_power2_divisions": dict,
}
ROUNDUP_KEYS = [str(1 << i) for i in range(16)]
METADATA_RE = re.compile(r"^category=(\S*) module=(\S*) op=(\S*) phase=(\S*)$")
MAX_ERRORS = 30


class Checker:
    def __init__(self, tally):
        self.tally = tally
        self.errors = []
        self.stats = collections.Counter()

    def fail(self, msg):
        self.errors.append(msg)

    # ---- types

    def is_type(self, value, typ):
        if typ is int:
            return isinstance(value, int) and not isinstance(value, bool)
        return isinstance(value, typ)

    def check_keys(self, obj, where, required, optional=()):
        if not isinstance(obj, dict):
            self.fail(f"{where}: expected a dict, got {type(obj).__name__}")
            return False
        missing = [k for k in required if k not in obj]
        extra = [k for k in obj if k not in required and k not in optional]
        if missing:
            self.fail(f"{where}: missing keys {missing}")
        if extra:
            self.fail(f"{where}: unexpected keys {extra}")
        ok = not missing
        for k, typ in required.items():
            if k in obj and not self.is_type(obj[k], typ):
                self.fail(f"{where}: key {k!r} has type {type(obj[k]).__name__}, "
                          f"expected {typ.__name__}")
                ok = False
        return ok

    def check_frames(self, frames, where):
        if not isinstance(frames, list):
            self.fail(f"{where}: frames is not a list")
            return
        for i, f in enumerate(frames):
            self.check_keys(f, f"{where} frame {i}", FRAME_KEYS, FRAME_OPTIONAL_KEYS)

    # ---- bytes

    def check_bytes(self, data):
        if self.tally and data[:2] != b"\x80\x02":
            self.fail(f"header is {data[:2].hex(' ')}, expected 80 02 (PROTO 2)")
        elif not self.tally and (data[:1] != b"\x80" or len(data) < 2 or not 2 <= data[1] <= 4):
            self.fail(f"header is {data[:2].hex(' ')}, expected PROTO 2..4")
        allowed = ALLOWED_OPCODES | (set() if self.tally else PYTORCH_EXTRA_OPCODES)
        marks = []
        depth = 0
        counts = collections.Counter()
        bad = collections.Counter()
        stopped = False
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            counts[name] += 1
            if name not in allowed:
                bad[name] += 1
            if name == "LONG1" and data[pos + 1] > 8:
                self.fail(f"LONG1 of {data[pos + 1]} bytes at offset {pos} ({arg}), max 8")
            if name == "MARK":
                marks.append(depth)
            elif name in ("APPENDS", "SETITEMS", "TUPLE", "DICT", "LIST"):
                n = depth - marks.pop()
                items = n // 2 if name == "SETITEMS" else n
                if name in ("APPENDS", "SETITEMS") and items > MAX_BATCH:
                    self.fail(f"{name} batch of {items} items at offset {pos} (max {MAX_BATCH})")
                depth -= n
                if name in ("TUPLE", "DICT", "LIST"):
                    depth += 1
            elif name in ("TUPLE2",):
                depth -= 1
            elif name in ("TUPLE3",):
                depth -= 2
            elif name in ("APPEND",):
                depth -= 1
            elif name in ("SETITEM",):
                depth -= 2
            elif name in ("NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "LONG1",
                          "BINFLOAT", "BINUNICODE", "SHORT_BINUNICODE", "EMPTY_LIST",
                          "EMPTY_DICT", "EMPTY_TUPLE", "BINGET", "LONG_BINGET"):
                depth += 1
            elif name == "STOP":
                stopped = True
        if bad:
            self.fail(f"opcodes outside the viewer's subset: {dict(bad)}")
        if not stopped:
            self.fail("no STOP opcode")
        self.stats["memo_gets"] = counts["BINGET"] + counts["LONG_BINGET"]

    # ---- top level

    def check(self, snap):
        if not isinstance(snap, dict):
            self.fail(f"top level is a {type(snap).__name__}, expected a dict")
            return
        top_required = {"segments": list, "device_traces": list}
        top_optional = {"allocator_settings": dict, "external_annotations": list}
        if self.tally:
            top_required.update(top_optional)
            top_optional = {}
        if not self.check_keys(snap, "snapshot", top_required, top_optional):
            return
        if self.tally and snap["external_annotations"] != []:
            self.fail("external_annotations is not an empty list")
        if "allocator_settings" in snap:
            self.check_settings(snap["allocator_settings"])
        traces = snap["device_traces"]
        for d, t in enumerate(traces):
            if not isinstance(t, list):
                self.fail(f"device_traces[{d}] is not a list")
                return
        segs_by_device = collections.defaultdict(list)
        for i, seg in enumerate(snap["segments"]):
            if self.check_segment(seg, i):
                segs_by_device[seg["device"]].append(seg)
                if traces and not 0 <= seg["device"] < len(traces):
                    self.fail(f"segment {i}: device {seg['device']} has no device_traces list")
        for device, segs in segs_by_device.items():
            self.check_overlap(device, segs)
        entries_ok = True
        all_entries = [e for t in traces for e in t]
        for d, trace in enumerate(traces):
            for j, e in enumerate(trace):
                entries_ok &= self.check_entry(e, f"device_traces[{d}][{j}]")
        if self.tally and all_entries and entries_ok:
            if not any(e.get("category") == "unknown" for e in all_entries):
                self.fail("no trace entry has category 'unknown' (the viewer breaks, §7 pitfall 1)")
        if self.tally:
            self.check_frames_shared(snap)
        if not entries_ok:
            return  # replays need well-formed entries
        for d, trace in enumerate(traces):
            self.replay_forward(d, trace, segs_by_device.get(d, []))
            self.replay_backward(d, trace, segs_by_device.get(d, []))

    def check_settings(self, s):
        if not self.check_keys(s, "allocator_settings", SETTINGS_KEYS):
            return
        r = s["roundup_power2_divisions"]
        if list(r) != ROUNDUP_KEYS:
            self.fail(f"roundup_power2_divisions keys {list(r)}, expected {ROUNDUP_KEYS}")
        for k, v in r.items():
            if not self.is_type(v, int) or v < 0:
                self.fail(f"roundup_power2_divisions[{k!r}] = {v!r} is not an int >= 0")
        if s["max_split_size"] < -1:
            self.fail(f"max_split_size {s['max_split_size']} < -1")
        if s["pinned_num_register_threads"] != 1 and self.tally:
            self.fail("pinned_num_register_threads is not 1")

    # ---- segments and blocks

    def check_segment(self, seg, i):
        where = f"segment {i}"
        if not self.check_keys(seg, where, SEGMENT_KEYS):
            return False
        where = f"segment {i} (device {seg['device']}, address {seg['address']:#x})"
        ok = True
        if seg["segment_type"] not in ("small", "large"):
            self.fail(f"{where}: segment_type {seg['segment_type']!r}")
        pool = seg["segment_pool_id"]
        if len(pool) != 2 or not all(self.is_type(x, int) for x in pool):
            self.fail(f"{where}: segment_pool_id {pool!r} is not a pair of ints")
        if self.tally and pool != (0, 0):
            self.fail(f"{where}: segment_pool_id {pool!r}, Tally has only the default pool")
        self.check_frames(seg["frames"], where)
        if seg["total_size"] <= 0:
            self.fail(f"{where}: total_size {seg['total_size']}")
        addr = seg["address"]
        allocated = active = requested = 0
        for j, b in enumerate(seg["blocks"]):
            bwhere = f"{where} block {j}"
            if not self.check_keys(b, bwhere, BLOCK_KEYS):
                ok = False
                continue
            self.stats["blocks"] += 1
            self.stats[b["state"]] += 1
            self.check_frames(b["frames"], bwhere)
            if b["address"] != addr:
                self.fail(f"{bwhere}: address {b['address']:#x}, expected {addr:#x} "
                          f"(blocks must tile the segment in address order)")
            if b["size"] <= 0:
                self.fail(f"{bwhere}: size {b['size']}")
            addr = b["address"] + b["size"]
            if b["state"] not in BLOCK_STATES:
                self.fail(f"{bwhere}: state {b['state']!r}")
                continue
            if b["state"] != "inactive":
                active += b["size"]
                requested += b["requested_size"]
                if b["state"] == "active_allocated":
                    allocated += b["size"]
                if not 0 < b["requested_size"] <= b["size"]:
                    self.fail(f"{bwhere}: requested_size {b['requested_size']} not in "
                              f"(0, size {b['size']}]")
                if self.tally and not b["frames"]:
                    self.fail(f"{bwhere}: active block without frames")
            elif self.tally and b["frames"]:
                self.fail(f"{bwhere}: inactive block with frames")
        if addr != seg["address"] + seg["total_size"]:
            self.fail(f"{where}: blocks cover {addr - seg['address']} bytes, total_size is "
                      f"{seg['total_size']} (blocks must tile the segment)")
        for key, value in (("allocated_size", allocated), ("active_size", active),
                           ("requested_size", requested)):
            if seg[key] != value:
                self.fail(f"{where}: {key} {seg[key]}, blocks say {value}")
        self.stats["segments"] += 1
        return ok

    def check_overlap(self, device, segs):
        segs = sorted(segs, key=lambda s: s["address"])
        for a, b in zip(segs, segs[1:]):
            if a["address"] + a["total_size"] > b["address"]:
                self.fail(f"device {device}: segments {a['address']:#x} and {b['address']:#x} "
                          f"overlap")

    # ---- trace entries

    def check_entry(self, e, where):
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            self.fail(f"{where}: not a dict with a string 'action'")
            return False
        action = e["action"]
        actions = TALLY_ACTIONS if self.tally else PYTORCH_ACTIONS
        if action not in actions:
            self.fail(f"{where}: action {action!r}")
            return False
        required = dict(ENTRY_COMMON_KEYS)
        required.update({"device_free": int} if action == "oom" else {"addr": int})
        optional = ()
        if self.tally:
            required["category"] = str
        else:
            # PyTorch writes frames only when a stack was recorded.
            del required["frames"]
            optional = ("category", "frames")
        if not self.check_keys(e, f"{where} ({action})", required, optional):
            return False
        self.stats["entries"] += 1
        self.stats["action:" + action] += 1
        where = f"{where} ({action} {e.get('addr', 0):#x})"
        self.check_frames(e.get("frames", []), where)
        if action == "snapshot" and e["addr"] != 0:
            self.fail(f"{where}: snapshot entry with addr != 0")
        if action == "alloc" and e["size"] <= 0:
            self.fail(f"{where}: alloc of size {e['size']} (the viewer draws nothing)")
        if e["size"] < 0:
            self.fail(f"{where}: negative size")
        if "category" in e and e["category"] not in CATEGORIES:
            self.fail(f"{where}: category {e['category']!r}")
        if self.tally:
            if not 10**15 <= e["time_us"] < 10**17:
                self.fail(f"{where}: time_us {e['time_us']} is not microseconds since the epoch")
            if e["compile_context"] != "N/A":
                self.fail(f"{where}: compile_context {e['compile_context']!r}")
            m = METADATA_RE.match(e["user_metadata"])
            if not m:
                self.fail(f"{where}: user_metadata {e['user_metadata']!r} is not "
                          f"'category=… module=… op=… phase=…'")
            elif m.group(1) != e["category"]:
                self.fail(f"{where}: user_metadata category {m.group(1)!r} != category "
                          f"{e['category']!r}")
            if action.startswith("segment_") and e["category"] != "unknown":
                self.fail(f"{where}: segment event with category {e['category']!r}")
            if action != "snapshot" and not e["frames"]:
                self.fail(f"{where}: no frames")
            if action in ("alloc", "free_requested", "free_completed", "oom") and e["frames"]:
                last = e["frames"][-1].get("filename")
                if last != "category=" + e["category"]:
                    self.fail(f"{where}: outermost frame {last!r} does not name category "
                              f"{e['category']!r}")
        return True

    def check_frames_shared(self, snap):
        """Equal non-empty frame lists must be one object (memo references)."""
        by_value = {}
        lists = [s["frames"] for s in snap["segments"] if isinstance(s, dict) and "frames" in s]
        for s in snap["segments"]:
            if isinstance(s, dict):
                lists += [b["frames"] for b in s.get("blocks", []) if isinstance(b, dict)
                          and "frames" in b]
        lists += [e["frames"] for t in snap["device_traces"] for e in t
                  if isinstance(e, dict) and "frames" in e]
        for fl in lists:
            if not isinstance(fl, list) or not fl:
                continue
            try:
                key = repr(fl)
            except Exception:  # noqa: BLE001 - any odd content was reported elsewhere
                continue
            first = by_value.setdefault(key, fl)
            if first is not fl:
                self.fail(f"equal frame lists are not shared (memo): {key[:120]}")
                return
        self.stats["distinct_frames"] = len(by_value)

    # ---- replays

    def replay_forward(self, device, trace, segs):
        """Forward replay of block events; the end state must match the active blocks."""
        where = f"device {device}"
        state = {}  # addr -> ("live", alloc entry) | ("dead", None)
        last_event = {}  # addr -> action of the last block event
        initially = set()
        prev_time = None
        for j, e in enumerate(trace):
            action = e["action"]
            if prev_time is not None and e["time_us"] < prev_time:
                self.fail(f"{where} entry {j}: time_us goes backwards "
                          f"({prev_time} -> {e['time_us']})")
            prev_time = e["time_us"]
            if action not in ("alloc", "free_requested", "free_completed"):
                continue
            addr = e["addr"]
            cur = state.get(addr)
            ewhere = f"{where} entry {j} ({action} {addr:#x})"
            if action == "alloc":
                if cur and cur[0] == "live":
                    self.fail(f"{ewhere}: address already live (allocated at entry "
                              f"{cur[2]} and not freed)")
                state[addr] = ("live", e, j)
            elif action == "free_requested":
                if cur and cur[0] == "dead":
                    self.fail(f"{ewhere}: free_requested of a freed address")
                elif cur and e["size"] != cur[1]["size"]:
                    self.fail(f"{ewhere}: size {e['size']} != alloc size {cur[1]['size']}")
            else:  # free_completed
                if cur is None:
                    initially.add(addr)  # allocated before the trace window
                elif cur[0] == "dead":
                    self.fail(f"{ewhere}: free_completed of an address already freed")
                elif e["size"] != cur[1]["size"]:
                    self.fail(f"{ewhere}: size {e['size']} != alloc size {cur[1]['size']}")
                state[addr] = ("dead", None, j)
            last_event[addr] = action

        active = {}
        for seg in segs:
            for b in seg["blocks"]:
                if b["state"] != "inactive":
                    active[b["address"]] = b
        live = {a for a, s in state.items() if s[0] == "live"}
        for addr in sorted(live):
            alloc = state[addr][1]
            b = active.get(addr)
            if b is None:
                self.fail(f"{where}: {addr:#x} allocated at entry {state[addr][2]} and never "
                          f"freed, but no active block has that address")
                continue
            if alloc["size"] != b["requested_size"]:
                self.fail(f"{where}: block {addr:#x} requested_size {b['requested_size']} != "
                          f"its alloc size {alloc['size']}")
            pending = last_event[addr] == "free_requested"
            if pending != (b["state"] == "active_pending_free"):
                self.fail(f"{where}: block {addr:#x} is {b['state']} but its last event is "
                          f"{last_event[addr]}")
        ghosts = 0
        for addr, b in active.items():
            s = state.get(addr)
            if s is None:
                ghosts += 1  # allocated before the trace window
            elif s[0] == "dead":
                self.fail(f"{where}: block {addr:#x} is {b['state']} but the trace frees it at "
                          f"entry {s[2]} and never allocates it again")
        self.stats["live_in_trace"] += len(live)
        self.stats["initially_allocated"] += len(initially)
        self.stats["ghost_blocks"] += ghosts

    def replay_backward(self, device, trace, segs):
        """Walk back from `segments` as the viewer's Allocator State History does."""
        where = f"device {device}"
        blocks = {}
        for seg in segs:
            for b in seg["blocks"]:
                if b["state"] != "inactive":
                    blocks[b["address"]] = b["size"]
        segments = {s["address"]: s["total_size"] for s in segs}
        streams = {s["address"]: s["stream"] for s in segs}

        def holder(addr, size):
            return next((a for a, n in segments.items() if a <= addr and addr + size <= a + n),
                        None)

        for j in range(len(trace) - 1, -1, -1):
            e = trace[j]
            action = e["action"]
            ewhere = f"{where} entry {j} ({action} {e.get('addr', 0):#x})"
            if action == "free_completed":
                blocks[e["addr"]] = e["size"]
            elif action == "alloc":
                if e["addr"] not in blocks:
                    self.fail(f"{ewhere}: allocated here but neither active at the end nor "
                              f"freed later")
                blocks.pop(e["addr"], None)
                if holder(e["addr"], e["size"]) is None:
                    self.fail(f"{ewhere}: no segment holds this allocation at this point")
            elif action == "free_requested":
                if e["addr"] not in blocks:
                    self.fail(f"{ewhere}: freed here but not live at this point "
                              f"(breaks the viewer's Allocator State History, §7 pitfall 3)")
            elif action == "segment_free":
                if e["addr"] in segments:
                    self.fail(f"{ewhere}: segment freed here is present at the end without a "
                              f"later segment_alloc")
                segments[e["addr"]] = e["size"]
                streams[e["addr"]] = e["stream"]
            elif action == "segment_alloc":
                if segments.get(e["addr"]) != e["size"]:
                    self.fail(f"{ewhere}: segment allocated here is neither present at the end "
                              f"(with this size) nor freed later")
                segments.pop(e["addr"], None)
                streams.pop(e["addr"], None)
            elif action == "segment_unmap":
                # Expandable segments: before this the pages were mapped, part of the run
                # they touch on either side (the viewer merges them the same way).
                if holder(e["addr"], 1) is not None:
                    self.fail(f"{ewhere}: pages unmapped here are mapped at the end without a "
                              f"later segment_map")
                    continue
                addr, size, stream = e["addr"], e["size"], e["stream"]
                after = addr + size
                if after in segments and streams[after] == stream:
                    size += segments.pop(after)
                    streams.pop(after)
                before = next((a for a, n in segments.items()
                               if a + n == addr and streams[a] == stream), None)
                if before is not None:
                    size += addr - before
                    addr = before
                segments[addr] = size
                streams[addr] = stream
            elif action == "segment_map":
                # Before this the pages were not mapped: they leave the run holding them.
                h = holder(e["addr"], e["size"])
                if h is None:
                    self.fail(f"{ewhere}: pages mapped here are in no segment at the end nor "
                              f"unmapped later")
                    continue
                n, stream = segments.pop(h), streams.pop(h)
                end = e["addr"] + e["size"]
                if h < e["addr"]:
                    segments[h], streams[h] = e["addr"] - h, stream
                if end < h + n:
                    segments[end], streams[end] = h + n - end, stream
                inside = [a for a in blocks if e["addr"] <= a < end]
                if inside:
                    self.fail(f"{ewhere}: blocks {[hex(a) for a in inside[:4]]} are live in "
                              f"pages before they are mapped")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--expect-live", type=int, default=None, metavar="N",
                    help="require exactly N active_allocated blocks")
    ap.add_argument("--pytorch", action="store_true",
                    help="a snapshot written by PyTorch: skip Tally-only checks")
    ap.add_argument("--quiet", action="store_true", help="print nothing on success")
    args = ap.parse_args(argv)

    try:
        with open(args.file, "rb") as f:
            data = f.read()
        snap = pickle.loads(data)
    except Exception as ex:  # noqa: BLE001 - report any load failure the same way
        print(f"check_snapshot: FAIL {args.file}: cannot load: {type(ex).__name__}: {ex}",
              file=sys.stderr)
        return 2

    c = Checker(tally=not args.pytorch)
    try:
        c.check_bytes(data)
    except Exception as ex:  # noqa: BLE001
        c.fail(f"cannot walk the opcodes: {type(ex).__name__}: {ex}")
    c.check(snap)
    if args.expect_live is not None and c.stats["active_allocated"] != args.expect_live:
        c.fail(f"{c.stats['active_allocated']} active_allocated blocks, expected "
               f"{args.expect_live}")

    if c.errors:
        print(f"check_snapshot: FAIL {args.file}: {len(c.errors)} problem(s)", file=sys.stderr)
        for msg in c.errors[:MAX_ERRORS]:
            print(f"  - {msg}", file=sys.stderr)
        if len(c.errors) > MAX_ERRORS:
            print(f"  ... and {len(c.errors) - MAX_ERRORS} more", file=sys.stderr)
        return 1
    if not args.quiet:
        s = c.stats
        actions = ",".join(f"{k[7:]}={v}" for k, v in sorted(s.items()) if k.startswith("action:"))
        print(f"check_snapshot: OK {args.file}: {s['segments']} segments, {s['blocks']} blocks "
              f"({s['active_allocated']} allocated, {s['active_pending_free']} pending-free, "
              f"{s['inactive']} inactive), {s['entries']} trace entries ({actions or 'none'}), "
              f"{s['live_in_trace']} live in trace, {s['ghost_blocks']} ghost blocks, "
              f"{s['initially_allocated']} initially allocated, {s['memo_gets']} memo refs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
