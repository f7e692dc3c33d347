#!/usr/bin/env python3
"""bench/probes/timeline.py CSV — refit's copy launches per refit, from a cupti_timeline.cpp dump of the streamer
process. Each refit starts with copier::prime's empty kernel ("nothing"); for each it prints the time from there to
the first copy kernel, the copy kernels' busy time, their durations (us / blocks) and the idle gaps between them."""

import sys


def main(path: str) -> None:
    events = []
    with open(path) as f:
        for line in f:
            kind, start, end, _stream, grid, _block, name = line.rstrip("\n").split(",", 6)
            events.append((int(start), int(end), kind, name, int(grid)))
    events.sort()
    refits = []
    for start, end, kind, name, grid in events:
        if kind != "K":
            continue
        if "nothing" in name:
            refits.append((end, []))
        elif "copy_tiles" in name and refits:
            refits[-1][1].append((start, end, grid))
    for primed, copies in refits:
        if not copies:
            continue
        busy = sum(e - s for s, e, _ in copies)
        gaps = [copies[i + 1][0] - copies[i][1] for i in range(len(copies) - 1)]
        print(f"refit: prime -> first copy {(copies[0][0] - primed) / 1e3:.1f} us; {len(copies)} launches; "
              f"span {(copies[-1][1] - copies[0][0]) / 1e3:.1f} us; busy {busy / 1e3:.1f} us; gaps {sum(gaps) / 1e3:.1f} us")
        print("   launches (us/blocks):", " ".join(f"{(e - s) / 1e3:.0f}/{g}" for s, e, g in copies))
        print("   gaps (us):", " ".join(f"{x / 1e3:.1f}" for x in gaps))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: bench/probes/timeline.py CSV")
    main(sys.argv[1])
