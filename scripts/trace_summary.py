#!/usr/bin/env python3
"""Sum up an engine trace written by `tandem serve --trace FILE` (or generate, or bench's
serve section): each engine's busy time and the gaps between its spans, the decode steps by
batch size (how long they take alone and while a prefill runs on another engine), and a
timeline in slices of the run (prefill tokens, decode steps, mean batch).

    python3 scripts/trace_summary.py trace.json [--slice-ms 100]

Standard library only. A trace cut off by a killed server (no closing bracket) is read too.
"""
import argparse
import bisect
import json
import statistics
import sys


def load(path):
    text = open(path).read().rstrip()
    if not text:
        return []
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def fmt_ms(values):
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def overlaps(intervals, starts, t0, t1):
    """Whether [t0, t1) meets any of the sorted, non-overlapping intervals."""
    i = bisect.bisect_right(starts, t1) - 1
    while i >= 0:
        s, e = intervals[i]
        if e <= t0:
            return False
        if s < t1:
            return True
        i -= 1
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--slice-ms", type=float, default=100.0)
    a = ap.parse_args()
    events = [e for e in load(a.trace) if e.get("ph") == "X"]
    if not events:
        sys.exit(f"{a.trace}: no spans")
    t_start = min(e["ts"] for e in events)
    t_end = max(e["ts"] + e["dur"] for e in events)
    span_s = (t_end - t_start) / 1e6
    print(f"{len(events)} spans over {span_s:.3f} s")

    print("\n| track | work | spans | busy s | share of the trace | gaps between spans s |")
    print("|---|---|---|---|---|---|")
    tracks = sorted({e["tid"] for e in events})
    for tid in tracks:
        mine = sorted((e for e in events if e["tid"] == tid), key=lambda e: e["ts"])
        gaps = sum(max(0.0, b["ts"] - (x["ts"] + x["dur"])) for x, b in zip(mine, mine[1:])) / 1e6
        for name in sorted({e["name"] for e in mine}):
            busy = sum(e["dur"] for e in mine if e["name"] == name) / 1e6
            n = sum(1 for e in mine if e["name"] == name)
            print(f"| {tid} | {name} | {n} | {busy:.3f} | {100 * busy / span_s:.0f}% | {gaps:.3f} |")

    cache = {}
    for e in events:
        if e["name"] in ("snapshot", "restore", "demote", "cache keep", "cache lookup"):
            label = e["name"] + (f" from {e['args']['tier']}" if "tier" in e.get("args", {}) else "")
            cache.setdefault(label, []).append(e)
    if cache:
        print("\nPrefix cache spans (ms and the state's tokens: median, min-max):")
        print("\n| work | spans | ms | tokens |")
        print("|---|---|---|---|")
        for label, es in sorted(cache.items()):
            tokens = [e["args"]["tokens"] for e in es if "tokens" in e.get("args", {})]
            tok = f"{statistics.median(tokens):.0f} ({min(tokens)}-{max(tokens)})" if tokens else "-"
            print(f"| {label} | {len(es)} | {fmt_ms([e['dur'] / 1e3 for e in es])} | {tok} |")

    prefills = sorted(((e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events if e["name"] == "prefill"))
    steps = [e for e in events if e["name"] == "decode step"]
    samples = sorted((e for e in events if e["name"] == "sample"), key=lambda e: e["ts"])
    if steps:
        print("\nDecode steps by batch size (ms: median, min-max), alone or while a prefill of another engine runs:")
        print("\n| sequences | steps | ms alone | steps with a prefill | ms with a prefill | sampling ms |")
        print("|---|---|---|---|---|---|")
        # Each track's view of the prefills on the other tracks: the intervals and their starts.
        others = {}
        for tid in {e["tid"] for e in steps}:
            other = [(s, t) for s, t, ptid in prefills if ptid != tid]
            others[tid] = (other, [s for s, _ in other])
        buckets = [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 1 << 30]
        for lo, hi in zip(buckets, buckets[1:]):
            mine = [e for e in steps if lo <= e["args"]["sequences"] < hi]
            if not mine:
                continue
            alone, shared = [], []
            for e in mine:
                other, starts = others[e["tid"]]
                (shared if overlaps(other, starts, e["ts"], e["ts"] + e["dur"]) else alone).append(e["dur"] / 1e3)
            samp = [e["dur"] / 1e3 for e in samples if lo <= e["args"]["sequences"] < hi]
            label = f"{lo}" if hi == lo + 1 else f"{lo}-{min(hi - 1, 4096)}"
            print(f"| {label} | {len(alone) + len(shared)} | {fmt_ms(alone)} | {len(shared)} | {fmt_ms(shared)} | {fmt_ms(samp)} |")
        tokens = sum(e["args"]["sequences"] for e in steps)
        print(f"\n{len(steps)} steps, {tokens} tokens, {tokens / len(steps):.1f} sequences a step on average")

    width = a.slice_ms * 1e3
    n = int((t_end - t_start) // width) + 1
    print(f"\nTimeline in slices of {a.slice_ms:g} ms (calls, tokens and steps counted where they start; busy: the share of the slice):")
    print("\n| from s | prefill calls | prompt tokens | prefill busy | decode steps | mean sequences | decode busy |")
    print("|---|---|---|---|---|---|---|")
    rows = [[0, 0, 0.0, 0, 0, 0.0] for _ in range(n)]

    def spread(e, col):
        # The span's time, split over the slices it covers.
        t0, t1 = e["ts"] - t_start, e["ts"] - t_start + e["dur"]
        i = int(t0 // width)
        while i < n and i * width < t1:
            rows[i][col] += min(t1, (i + 1) * width) - max(t0, i * width)
            i += 1

    for e in events:
        r = rows[int((e["ts"] - t_start) // width)]
        if e["name"] == "prefill":
            r[0] += 1
            r[1] += e["args"]["tokens"]
            spread(e, 2)
        elif e["name"] == "decode step":
            r[3] += 1
            r[4] += e["args"]["sequences"]
            spread(e, 5)
        elif e["name"] == "sample":
            spread(e, 5)
    for i, (pc, pt, pb, ds, seqs, db) in enumerate(rows):
        mean = f"{seqs / ds:.0f}" if ds else "-"
        print(f"| {i * a.slice_ms / 1e3:.3f} | {pc} | {pt} | {100 * pb / width:.0f}% | {ds} | {mean} | {100 * db / width:.0f}% |")


if __name__ == "__main__":
    main()
