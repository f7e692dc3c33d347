"""python3 -m refit.bench — refit-bench's presets through the Python API.

Streams the same models (names, shapes, dtype: read from ``refit-bench --print-manifest``) with
``refit.Streamer.refit(version, state_dict)`` into ``refit.Receiver`` processes holding the same
tensors, every refit with fresh data and verified by checksums; with ``--compare`` it runs
refit-bench (C++) on the same rows in the same call and reports the Python overhead: the
difference of the medians, per refit and per tensor.

Example (a GPU node, from a bundle)::

    python3 -m refit.bench --refit-bench ./refit-bench --model llama3-8b --transport cuda_ipc \\
        --path direct --buffer-mb 256 --iters 20 --compare --json py-llama.json

The table follows refit-bench's (nccl-tests style): a ``#`` preamble, two header rows, one row
per (transport, model, path, buffer size), a wrong-values footer. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

TORCH_DTYPES = {
    "bool": "bool", "u8": "uint8", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "f8_e4m3": "float8_e4m3fn", "f8_e5m2": "float8_e5m2",
}


def log(msg: str) -> None:
    print(f"refit.bench: {msg}", file=sys.stderr, flush=True)


def manifests(refit_bench: str, models: List[str], dtype: str) -> List[Dict[str, Any]]:
    out = subprocess.run([refit_bench, "--model", ",".join(models), "--dtype", dtype, "--print-manifest"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def make_tensors(torch, manifest, device, arena: bool = False):
    """The manifest's tensors, each its own torch allocation (as a model's parameters are), or with
    `arena` all views of one allocation, 256-byte aligned (as refit-bench lays them out)."""
    tensors = {}
    if not arena:
        for name, dtype, shape in manifest["tensors"]:
            tensors[name] = torch.empty(shape, dtype=getattr(torch, TORCH_DTYPES[dtype]), device=device)
        return tensors
    metas, total = [], 0
    for name, dtype, shape in manifest["tensors"]:
        dt = getattr(torch, TORCH_DTYPES[dtype])
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty(0, dtype=dt).element_size()
        metas.append((name, dt, shape, total, nbytes))
        total += (nbytes + 255) // 256 * 256
    block = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    for name, dt, shape, off, nbytes in metas:
        tensors[name] = block[off:off + nbytes].view(dt).view(shape)
    return tensors


def fill(torch, tensors, seed: int) -> None:
    """Fresh bytes for every tensor (not timed)."""
    first = next(iter(tensors.values()))
    if first.device.type == "cpu":
        import numpy

        rng = numpy.random.default_rng(seed)
        for t in tensors.values():
            if t.numel():
                b = t.reshape(-1).view(torch.uint8)
                b.copy_(torch.from_numpy(numpy.frombuffer(rng.bytes(b.numel()), dtype=numpy.uint8).copy()))
        return
    g = torch.Generator(device=first.device)
    g.manual_seed(seed)
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).random_(0, 256, generator=g)


def checksums(torch, tensors) -> List[int]:
    """Two numbers per tensor: on the CPU its CRC-32 and length; on a GPU the sums of all its
    bytes and of its odd bytes. A lost, shifted or partial write changes them."""
    first = next(iter(tensors.values()), None)
    if first is None:
        return []
    if first.device.type == "cpu":
        import zlib

        out = []
        for t in tensors.values():
            b = t.reshape(-1).view(torch.uint8).numpy()
            out += [zlib.crc32(memoryview(b)), b.size]
        return out
    sums = []
    for t in tensors.values():
        b = t.reshape(-1).view(torch.uint8)
        sums.append(torch.sum(b, dtype=torch.int64))
        sums.append(torch.sum(b[1::2], dtype=torch.int64))
    return [int(s) for s in torch.stack(sums).cpu()]


def nccl_shares_gpus(args) -> bool:
    """Whether the nccl ranks (the streamer and --receivers) outnumber the GPUs, so that some share
    one: each process then claims an NCCL host of its own (claim_nccl_host)."""
    if args.transport != "nccl":
        return False
    import torch

    return 0 < torch.cuda.device_count() < args.receivers + 1


def claim_nccl_host() -> None:
    """Before this process's first NCCL call, where ranks share a GPU: NCCL refuses two ranks of one
    communicator on one GPU of one host ("Duplicate GPU detected") and takes the host from
    NCCL_HOSTID; with a host of each process's own it connects them through its network transport
    over loopback instead."""
    os.environ["NCCL_HOSTID"] = f"refit-bench-{os.getpid()}"


def receiver_main(manifest, device_kind, device, conn, shared: bool = False) -> None:
    """A receiver process: the manifest's tensors as its parameter table; answers 'sums' and
    'stop' on `conn` between refits. `shared`: nccl ranks share GPUs (a host of its own)."""
    import threading

    import torch

    import refit

    if shared:
        claim_nccl_host()
    dev = "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(device)
        dev = f"cuda:{device}"
    tensors = make_tensors(torch, manifest, dev)
    rx = refit.Receiver(device=device if device_kind == "cuda" else None, idle_timeout=300.0)
    rx.add_parameters(tensors)
    stop = threading.Event()
    server = threading.Thread(target=rx.serve, args=(stop,), kwargs={"poll": 0.05}, daemon=True)
    server.start()
    conn.send(rx.endpoint)
    while True:
        if not conn.poll(600):
            break
        cmd = conn.recv()
        if cmd == "stop":
            break
        if cmd == "sums":
            conn.send((rx.committed_version, checksums(torch, tensors)))
    stop.set()
    server.join()
    rx.close()


def run_row(torch, refit, manifest, args, path: str, buffer_mb: float) -> Dict[str, Any]:
    transport = args.transport
    cuda = transport != "host_shm"
    ctx = mp.get_context("spawn")
    nrecv = args.receivers if transport == "nccl" else 1
    ngpu = torch.cuda.device_count() if cuda else 0
    shared = nccl_shares_gpus(args)
    host_before = os.environ.get("NCCL_HOSTID")
    procs, conns = [], []
    for k in range(nrecv):
        rdev = (args.device + 1 + k) % ngpu if transport == "nccl" else args.device
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=receiver_main, args=(manifest, "cuda" if cuda else "cpu", rdev, theirs, shared),
                        daemon=True)
        p.start()
        procs.append(p)
        conns.append(mine)
    try:
        endpoints = []
        for c in conns:
            if not c.poll(600):
                raise RuntimeError("a receiver process did not start within 600 s")
            endpoints.append(c.recv())
        dev = f"cuda:{args.device}" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(args.device)
        tensors = make_tensors(torch, manifest, dev, arena=getattr(args, "arena", False))
        if shared:
            claim_nccl_host()  # until the row ends: refit-bench (--compare) claims its own
        st = refit.Streamer(endpoints[0], transport=transport, receivers=endpoints if transport == "nccl" else None,
                            buffer_bytes=int(buffer_mb * (1 << 20)), direct=(path == "direct"),
                            timeout=args.timeout, device=args.device if cuda else None)
        times, stats, wrong = [], [], 0
        with st:
            for it in range(args.warmup + args.iters):
                version = it + 1
                if args.announce:
                    st.announce()  # before the new weights are made, as a trainer before its step
                fill(torch, tensors, args.seed * 1000003 + version)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                s = st.refit(version, tensors)
                dt = time.perf_counter() - t0
                mine_sums = checksums(torch, tensors)
                for c in conns:
                    c.send("sums")
                for k, c in enumerate(conns):
                    if not c.poll(300):
                        raise RuntimeError(f"receiver {k} did not answer its checksums")
                    committed, theirs = c.recv()
                    if committed != version:
                        raise RuntimeError(f"receiver {k} has version {committed} committed, not {version}")
                    bad = sum(1 for i in range(0, len(theirs), 2) if theirs[i:i + 2] != mine_sums[i:i + 2])
                    if bad:
                        log(f"WRONG: {bad} tensors differ at receiver {k}, version {version}")
                    if it >= args.warmup:
                        wrong += bad
                if it >= args.warmup:
                    times.append(dt)
                    stats.append(s)
        nbytes = stats[0].bytes
        return {
            "transport": transport, "model": manifest["name"], "path": path, "api": "python",
            "buffer_mb": buffer_mb, "receivers": nrecv, "tensors": stats[0].tensors, "bytes": nbytes,
            "iters": args.iters, "direct": stats[0].direct, "arena": bool(getattr(args, "arena", False)),
            "announce": args.announce,
            "time_ms": {"median": statistics.median(times) * 1e3, "min": min(times) * 1e3, "max": max(times) * 1e3},
            "gbps": nbytes / statistics.median(times) / 1e9,
            "source_ms": statistics.median(s.source_seconds for s in stats) * 1e3,
            "wait_ms": statistics.median(s.wait_seconds for s in stats) * 1e3,
            # refit() through Python minus the C++ refit inside it (RefitStats.seconds): the call
            # into the binding and back, measured within each refit (no pacing between refits in it)
            "outside_ms": statistics.median(t - s.seconds for t, s in zip(times, stats)) * 1e3,
            "wrong": wrong,
        }
    finally:
        for c in conns:
            try:
                c.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        if host_before is None:
            os.environ.pop("NCCL_HOSTID", None)
        else:
            os.environ["NCCL_HOSTID"] = host_before


def cpp_row(args, model: str, path: str, buffer_mb: float) -> Optional[Dict[str, Any]]:
    """The same row through refit-bench (C++), in this call."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [args.refit_bench, "--transport", args.transport, "--model", model, "--dtype", args.dtype,
               "--buffer-mb", str(buffer_mb), "--path", path, "--iters", str(args.iters), "--warmup",
               str(args.warmup), "--device", str(args.device), "--receivers", str(args.receivers),
               "--seed", str(args.seed), "--timeout-ms", str(int(args.timeout * 1000)), "--json", out, "-q"]
        if nccl_shares_gpus(args):
            cmd.append("--nccl-share-gpus")  # refit-bench shares GPUs only when told
        if args.announce:
            cmd.append("--announce")
        log("C++ row: " + " ".join(cmd))
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            log(f"refit-bench failed ({r.returncode}): {r.stderr[-2000:]}")
            return None
        rows = json.load(open(out))["rows"]
        return rows[0] if rows else None


def print_table(pre: List[str], rows: List[Dict[str, Any]]) -> None:
    for line in pre:
        print(f"# {line}")
    print("#")
    h1 = ("api", "transport", "model", "path", "buf_MiB", "tensors", "bytes", "median", "min", "max", "GB/s",
          "source", "vs C++", "ovh/refit", "ovh/tensor", "wrong")
    h2 = ("", "", "", "", "", "", "(GB)", "(ms)", "(ms)", "(ms)", "", "(ms)", "(ratio)", "(ms)", "(us)", "")
    fmt = "{:>7} {:>10} {:>16} {:>7} {:>7} {:>7} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10} {:>6}"
    print("#" + fmt.format(*h1)[1:])
    print("#" + fmt.format(*h2)[1:])
    for r in rows:
        t = r["time_ms"]
        print(fmt.format(
            r["api"], r["transport"], r["model"], r["path"], f"{r['buffer_mb']:g}", r["tensors"],
            f"{r['bytes'] / 1e9:.3f}", f"{t['median']:.2f}", f"{t['min']:.2f}", f"{t['max']:.2f}", f"{r['gbps']:.1f}",
            f"{r.get('source_ms', float('nan')):.2f}", f"{r['vs_cpp']:.3f}" if "vs_cpp" in r else "-",
            f"{r['overhead_ms']:.3f}" if "overhead_ms" in r else "-",
            f"{r['overhead_us_per_tensor']:.3f}" if "overhead_us_per_tensor" in r else "-",
            r["wrong"] if r["wrong"] is not None else "n/a"))
    wrong = sum(r["wrong"] or 0 for r in rows)
    print(f"# Wrong values          : {wrong} {'OK' if wrong == 0 else 'FAILED'}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m refit.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refit-bench", default=shutil.which("refit-bench") or "refit-bench",
                    help="the refit-bench binary (for the presets' shapes and --compare)")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="built-in model(s), comma separated")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--transport", default="host_shm", choices=["host_shm", "cuda_ipc", "nccl"])
    ap.add_argument("--path", default="direct", help="direct, staged or both (comma separated)")
    ap.add_argument("--buffer-mb", default="64", help="buffer size(s) in MiB, comma separated")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--receivers", type=int, default=1,
                    help="nccl: receiver processes, receiver k on GPU (device + 1 + k) %% visible: one GPU each where "
                         "there are enough, else ranks share GPUs through NCCL's network transport over loopback")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--arena", action="store_true",
                    help="the streamer's tensors as views of one allocation (as refit-bench's), not one each")
    ap.add_argument("--announce", action="store_true",
                    help="Streamer.announce() before each refit's new weights are made (refit-bench --announce)")
    ap.add_argument("--compare", action="store_true", help="run refit-bench (C++) on the same rows in this call")
    ap.add_argument("--json", help="write the rows and the preamble to FILE")
    args = ap.parse_args(argv)

    import torch

    import refit

    models = [m for m in args.model.split(",") if m]
    mans = manifests(args.refit_bench, models, args.dtype)
    pre = [
        f"refit.bench (Python API): refit {refit.__version__}, Python {platform.python_version()}, torch {torch.__version__}",
        f"command   : {' '.join([sys.executable, '-m', 'refit.bench'] + (argv if argv is not None else sys.argv[1:]))}",
        f"host      : {platform.node()} (pid {os.getpid()}), {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        "gpu       : " + (", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
                          if torch.cuda.is_available() else "none"),
        f"iterations: {args.warmup} warm-up + {args.iters} counted per row, each a new version with fresh data; "
        "every refit verified by checksums",
        "vs C++ = C++ median / Python median (same row, same call); ovh = Python median - C++ median",
    ]
    if nccl_shares_gpus(args):
        pre.append(f"nccl      : {args.receivers + 1} ranks on {torch.cuda.device_count()} GPU(s): the ranks "
                   "share a GPU, each process with an NCCL host of its own (NCCL_HOSTID), so every byte goes "
                   "through NCCL's network transport over loopback: these are not NVLink figures")
    rows = []
    for man in mans:
        for path in [p for p in args.path.split(",") if p]:
            for mb in [float(b) for b in args.buffer_mb.split(",") if b]:
                log(f"{args.transport} {man['name']} {path} {mb:g} MiB")
                r = run_row(torch, refit, man, args, path, mb)
                rows.append(r)
                if args.transport != "host_shm":
                    # the row's tensors are gone; their memory goes back to the GPU for the next row
                    # (refit-bench's, which needs the same again: qwen3-30b-a3b on one GPU)
                    gc.collect()
                    torch.cuda.empty_cache()
                if args.compare:
                    c = cpp_row(args, man["name"], path, mb)
                    if c is not None:
                        c = dict(c, api="c++", path=path, gbps=c["gbps"], source_ms=c.get("source_ms", float("nan")))
                        rows.append(c)
                        med_py, med_c = r["time_ms"]["median"], c["time_ms"]["median"]
                        r["vs_cpp"] = med_c / med_py
                        r["overhead_ms"] = med_py - med_c
                        r["overhead_us_per_tensor"] = (med_py - med_c) * 1e3 / r["tensors"]
    print_table(pre, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preamble": pre, "rows": rows}, f, indent=1)
    return 0 if all((r["wrong"] or 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
