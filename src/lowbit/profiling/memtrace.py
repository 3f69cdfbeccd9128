"""What holds a CUDA device's memory at its peak, over a stretch of code (e.g. one decoder layer
of lowbit.pipelines.layerwise): the caching allocator's own trace (torch.cuda.memory's
_record_memory_history), replayed to the moment of the largest allocated total, and the blocks
alive then grouped by the line of lowbit / transformers code that allocated them.

Everything here is best effort: a diagnostic must never fail the run it observes, so `start`
and `stop` return None / an {"error": ...} record instead of raising.
"""
from __future__ import annotations

import os
import resource

import torch


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc/self/statm; 0 where unavailable):
    what the OS gives the process now, the host-side counterpart of the device traces below."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def start(device) -> int | None:
    """Begin recording (Python stacks) on `device`; returns memory_allocated at the start, or
    None when recording is unavailable (CPU, an old torch)."""
    if torch.device(device).type != "cuda":
        return None
    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=500_000)
        return torch.cuda.memory_allocated(device)
    except Exception:  # noqa: BLE001 - a diagnostic
        return None


def stop(device, base: int | None, top: int = 12) -> dict | None:
    """Stop recording and summarize the trace since `start` (its return value: `base`)."""
    if base is None:
        return None
    try:
        dev = torch.device(device)
        snap = torch.cuda.memory._snapshot(dev)
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap.get("device_traces") or []
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return summarize(traces[idx] if idx < len(traces) else [], base, top)
    except Exception as e:  # noqa: BLE001 - a diagnostic
        return {"error": f"{type(e).__name__}: {e}"}


def _short(f) -> str:
    fn = f.get("filename", "?")
    for root in ("lowbit", "transformers"):
        if f"/{root}/" in fn:
            fn = f"{root}/" + fn.split(f"/{root}/")[-1]
            break
    else:
        fn = fn.rsplit("/", 1)[-1]
    return f"{fn}:{f.get('line')} {f.get('name')}"


def _where(frames) -> str:
    """Where a block was allocated: the innermost frame in lowbit or transformers code (frames
    come innermost first), and when that is transformers, also the innermost lowbit frame
    that led there ('transformers/...:12 forward < lowbit/pipelines/layerwise.py:88 run')."""
    frames = frames or []
    mine = [f for f in frames if "/lowbit/" in f.get("filename", "") or "/transformers/" in f.get("filename", "")]
    if not mine:
        return _short(frames[0]) if frames else "?"
    out = _short(mine[0])
    if "/transformers/" in mine[0].get("filename", ""):
        low = [f for f in mine if "/lowbit/" in f.get("filename", "")]
        if low:
            out += " < " + _short(low[0])
    return out


def summarize(trace: list[dict], base: int, top: int = 12) -> dict:
    """Replay allocator trace entries ('alloc' adds a block, 'free_completed' removes it, as
    torch.cuda._memory_viz counts them) from `base` bytes allocated: the peak total, when it
    happened, and the blocks alive then by allocating line (largest first). Blocks allocated
    before the trace began appear as one line, less those freed before the peak."""
    cur = peak = base
    at = -1
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            cur += e["size"]
        elif a == "free_completed":
            cur -= e["size"]
        if cur > peak:
            peak, at = cur, i
    live: dict[int, tuple[int, str]] = {}
    before = base
    for e in trace[:at + 1]:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames")))
        elif a == "free_completed":
            if e["addr"] in live:
                del live[e["addr"]]
            else:
                before -= e["size"]
    by: dict[str, list[int]] = {}
    for size, where in live.values():
        s = by.setdefault(where, [0, 0])
        s[0] += size
        s[1] += 1
    biggest = sorted(live.items(), key=lambda kv: -kv[1][0])[:3]
    stacks = {}
    for e in trace[:at + 1]:          # the full stacks of the three largest live blocks
        if e.get("action") == "alloc" and e["addr"] in dict(biggest) and e["addr"] not in stacks:
            stacks[e["addr"]] = [_short(f) for f in (e.get("frames") or [])[:12]]
    rows = [{"where": w, "bytes": b, "blocks": n} for w, (b, n) in by.items()]
    rows.sort(key=lambda r: -r["bytes"])
    rows = rows[:top]
    rows.append({"where": "allocated before the trace began, still alive", "bytes": before, "blocks": None})
    return {"peak_bytes": peak, "allocated_at_start": base, "peak_entry": at, "entries": len(trace),
            "live_at_peak": rows,
            "largest_blocks": [{"bytes": size, "stack": stacks.get(addr, [])} for addr, (size, _) in biggest]}
