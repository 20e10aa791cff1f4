"""Where a profiled call leaves the GPU idle: a torch.profiler chrome trace (bench/learner.py writes one under $OUT)
-> the GPU's busy and idle time between its first and last kernel, the idle gaps by size, the host operations
that launched the kernel after each gap (what the GPU was waiting for), and the host's synchronizing CUDA calls.

  python3 bench/trace_gaps.py TRACE.json[.gz] [--top 15]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpyAsync",
         "cudaStreamWaitEvent", "cudaMalloc", "cudaFree")


def load(path: str) -> list[dict]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)["traceEvents"]


def gaps(events: list[dict], top: int = 15) -> str:
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        return "no GPU events in the trace"
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ops]
    t0, busy, end, idle = gpu[0]["ts"], 0.0, gpu[0]["ts"], []
    for e in gpu:  # the union of the kernels' intervals; a gap is time no kernel ran
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > end:
            idle.append((s - end, e))
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    span = end - t0

    def launcher(kernel) -> str:
        """The innermost host operations (up to three) around the runtime call that launched `kernel`."""
        rt = launches.get(kernel.get("args", {}).get("correlation"))
        if rt is None:
            return "?"
        i, names = bisect.bisect_right(starts, rt["ts"]), []
        for op in reversed(ops[max(0, i - 400):i]):
            if op["ts"] <= rt["ts"] <= op["ts"] + op["dur"] and op.get("tid") == rt.get("tid"):
                names.append(op["name"])
                if len(names) == 3:
                    break
        return " < ".join(names) or rt["name"]

    total_idle = sum(g for g, _ in idle)
    sizes = [(lo, hi, [g for g, _ in idle if lo <= g < hi]) for lo, hi in
             ((0, 10), (10, 100), (100, 1000), (1000, 10000), (10000, float("inf")))]
    lines = [f"GPU span {span / 1e3:.1f} ms: kernels {busy / 1e3:.1f} ms ({busy / span:.0%}), idle {total_idle / 1e3:.1f} ms "
             f"in {len(idle)} gaps; {len(gpu)} GPU events",
             "gaps by size: " + ", ".join(f"[{lo:g}, {hi:g}) us: {len(g)} = {sum(g) / 1e3:.1f} ms" for lo, hi, g in sizes)]
    by_op: dict[str, float] = defaultdict(float)
    for g, k in idle:
        if g >= 10:
            by_op[launcher(k)] += g
    lines.append("idle >= 10 us by what launched the next kernel:")
    lines += [f"  {t / 1e3:8.2f} ms  {name[:150]}" for name, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("largest gaps:")
    lines += [f"  {g / 1e3:8.2f} ms at +{(k['ts'] - t0) / 1e3:8.1f} ms before {k['name'][:60]} ({launcher(k)[:120]})"
              for g, k in sorted(idle, key=lambda x: -x[0])[:top]]
    syncs: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(e["name"].startswith(s.strip()) for s in SYNCS):
            syncs[e["name"]].append(e.get("dur", 0))
    lines.append("host CUDA calls that can wait: " + (", ".join(
        f"{n} x{len(d)} {sum(d) / 1e3:.1f} ms" for n, d in sorted(syncs.items(), key=lambda kv: -sum(kv[1]))) or "none"))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    print(gaps(load(a.trace), a.top))


if __name__ == "__main__":
    main()
