#!/usr/bin/env python3
"""bench/probes/timeline.py CSV — refit's copy launches per refit, from a cupti_timeline.cpp dump of the streamer
process. Each refit starts with copier::prime's empty kernel ("nothing"); for each it prints the time from there to
the first copy kernel, the copy kernels' busy time, their durations (us / blocks) and the idle gaps between them.

bench/probes/timeline.py --detail STREAMER_CSV [RECEIVER_CSV ...] [--log LOG] — with the calls recorded too
(CUPTI_API=1): one refit (the one of median span) as a list of what both processes did, in us from BEGIN's posting (from the
log), or else from the streamer's call that launched the empty kernel: each CUDA call (repeats of one call folded into one line), each kernel and copy
on the device, and refit's debug lines of LOG (REFIT_LOG=debug; placed by the clocks the CSV recorded)."""

import re
import statistics
import sys

CLOCKS = []  # CUPTI's clock less the monotonic clock, ns, one per CSV read


def load(path):
    events = []
    with open(path) as f:
        for line in f:
            kind, start, end, stream, grid, corr, name = line.rstrip("\n").split(",", 6)
            if kind == "T":
                CLOCKS.append(int(start) - int(end))  # CUPTI's clock less the monotonic one
                continue
            events.append((int(start), int(end), kind, name, int(grid), int(corr), int(stream)))
    events.sort()
    return events


def refits_of(events):
    refits = []
    for start, end, kind, name, grid, _corr, _stream in events:
        if kind != "K":
            continue
        if "nothing" in name:
            refits.append((end, []))
        elif "copy_tiles" in name and refits:
            refits[-1][1].append((start, end, grid))
    return refits


def summary(path: str) -> None:
    for primed, copies in refits_of(load(path)):
        if not copies:
            continue
        busy = sum(e - s for s, e, _ in copies)
        gaps = [copies[i + 1][0] - copies[i][1] for i in range(len(copies) - 1)]
        print(f"refit: prime -> first copy {(copies[0][0] - primed) / 1e3:.1f} us; {len(copies)} launches; "
              f"span {(copies[-1][1] - copies[0][0]) / 1e3:.1f} us; busy {busy / 1e3:.1f} us; gaps {sum(gaps) / 1e3:.1f} us")
        print("   launches (us/blocks):", " ".join(f"{(e - s) / 1e3:.0f}/{g}" for s, e, g in copies))
        print("   gaps (us):", " ".join(f"{x / 1e3:.1f}" for x in gaps))


def log_lines(path):
    """refit's debug lines of `path` as (start, end, "L", text, 0, 0, pid) on CUPTI's clock."""
    if not CLOCKS:
        return []
    shift = statistics.median(CLOCKS)
    out = []
    pattern = re.compile(r"^\S+:(\d+) refit DEBUG (\d+\.\d+) (.*)$")
    with open(path, errors="replace") as f:
        for line in f:
            m = pattern.match(line.rstrip("\n"))
            if m:
                t = int(round(float(m.group(2)) * 1e9)) + shift
                out.append((t, t, "L", m.group(3), 0, 0, int(m.group(1))))
    return out


def detail(streamer: str, receivers: list, log: str = "") -> None:
    mine = load(streamer)
    logged = log_lines(log) if log else []
    # A refit starts when its BEGIN is posted (the streamer's debug line says when the replies came, and after how
    # long); without a log, at the call that launched its empty kernel (copier::prime: the device's work names the
    # call's correlation id).
    begun = re.compile(r"BEGIN of .*version \d+: answered by \d+ receiver\(s\) in (\d+) us")
    starts = [t - int(m.group(1)) * 1000 for t, _e, _k, text, _g, _c, _p in logged if (m := begun.search(text))]
    if not starts:
        primes = {corr for _s, _e, kind, name, _g, corr, _t in mine if kind == "K" and "nothing" in name}
        starts = [s for s, _e, kind, call, corr, _c, _t in mine if kind in "RD" and corr in primes and "aunch" in call]
    starts = sorted(set(starts))
    if len(starts) < 2:
        sys.exit("timeline.py --detail: fewer than two refits found (record the calls with CUPTI_API=1, or give the "
                 "REFIT_LOG=debug log)")
    tagged = [("S",) + e for e in mine]
    for path in receivers:
        tagged += [("R",) + e for e in load(path)]
    tagged += [("L",) + e for e in logged]
    tagged.sort(key=lambda e: e[1])
    windows = []
    for i in range(len(starts) - 1):
        lo, hi = starts[i], starts[i + 1]
        # refit's copies: the copy kernel's launches and the copy engines' copies of a megabyte or more
        copies = [e for e in mine if lo <= e[0] < hi and ((e[2] == "K" and "copy_tiles" in e[3])
                                                          or (e[2] == "C" and e[4] >= 1 << 20))]
        if copies:
            windows.append((max(c[1] for c in copies) - lo, lo, hi))
    spans = sorted(w[0] for w in windows)
    print(f"{len(windows)} refits: BEGIN (or the priming call) -> last copy's end, median "
          f"{statistics.median(spans) / 1e3:.1f} us (min {spans[0] / 1e3:.1f}, max {spans[-1] / 1e3:.1f})")
    span, lo, hi = sorted(windows)[len(windows) // 2]
    print("the median refit, every call and device work from -100 us to the last copy + 200 us "
          "(S streamer, R receiver; calls: start +duration; repeats folded):")
    last = None
    for who, start, end, kind, name, grid, corr, stream in tagged:
        if start < lo - 100_000 or start > lo + span + 200_000:
            continue
        t = (start - lo) / 1e3
        d = (end - start) / 1e3
        if kind in "RD":
            key = (who, kind, name)
            if last and last[0] == key:
                last[1] += 1
                last[3] = (end - lo) / 1e3
                continue
            if last:
                flush(last)
            last = [key, 1, t, (end - lo) / 1e3, d]
            continue
        if last:
            flush(last)
            last = None
        if kind == "L":
            print(f"  {t:9.1f} log {stream} {name[:110]}")
            continue
        what = f"{grid} bytes" if kind == "C" else f"{grid} blocks"
        short = "copy_tiles" if "copy_tiles" in name else "nothing" if "nothing" in name else name
        print(f"  {t:9.1f} {who} device {short[:40]:40s} {d:8.1f} us  stream {stream}, {what}")
    if last:
        flush(last)


def flush(entry) -> None:
    (who, kind, name), n, t, end, d = entry
    if n == 1:
        print(f"  {t:9.1f} {who} call   {name[:40]:40s} {d:8.1f} us")
    else:
        print(f"  {t:9.1f} {who} call   {name[:40]:40s} x{n}, until {end:.1f}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--detail":
        args = sys.argv[2:]
        log = ""
        if "--log" in args:
            k = args.index("--log")
            log = args[k + 1]
            del args[k:k + 2]
        detail(args[0], args[1:], log)
    elif len(sys.argv) == 2:
        summary(sys.argv[1])
    else:
        sys.exit("usage: bench/probes/timeline.py CSV | --detail STREAMER_CSV [RECEIVER_CSV ...] [--log LOG]")
