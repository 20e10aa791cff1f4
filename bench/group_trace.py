"""What became of a run's groups, from its group_trace.jsonl (logging.group_trace; the GPU bench keeps one beside each
Tandem run's JSON as NAME-groups.jsonl): a line per batch, and why each group dropped past the bound was dropped.

  python3 bench/group_trace.py RUN-groups.jsonl

A dropped group finished but no batch took it while its version was fresh enough; it is dropped when the next batch
is collected, so the last take before its drop was its last chance. Either it was back before that take, which took
others of the same or an older version instead ("left at a take": more came back at once than the batch had room
for), or it came back after it ("back after its take": the take's stop did not reach it before it finished).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from statistics import median

from tandem.services.orchestrator.run_log import read_lines

BURST_S = 0.05  # groups back within this of the one before them: one burst (the engine finished them together)


def batches(lines: list[dict]) -> list[dict]:
    """The batches trained, in order: {cycle, taken_at, groups, versions, tokens, sampling_s (each group's, from its
    hand-out to its return)}."""
    back = {(g["epoch"], g["index"], g["version"]): g for g in lines if g["event"] == "returned"}
    by = {}
    for g in lines:
        if g["event"] == "trained":
            b = by.setdefault(g["cycle"], {"cycle": g["cycle"], "taken_at": g.get("taken_at"), "groups": 0,
                                           "versions": Counter(), "tokens": 0, "sampling_s": []})
            b["groups"] += 1
            b["versions"][g["version"]] += 1
            b["tokens"] += g.get("tokens") or 0
            r = back.get((g["epoch"], g["index"], g["version"]), {})
            if r.get("handed_out_at") is not None and r.get("returned_at") is not None:
                b["sampling_s"].append(r["returned_at"] - r["handed_out_at"])
    return [by[c] for c in sorted(by)]


def dropped_why(lines: list[dict]) -> Counter:
    """Each dropped group: 'left at a take' (back before the last take before its drop) or 'back after its take'."""
    takes = sorted({b["taken_at"] for b in batches(lines) if b["taken_at"] is not None})
    why = Counter()
    for g in lines:
        if g["event"] != "dropped":
            continue
        before = [t for t in takes if t <= g["time"]]
        back = g.get("returned_at")
        if not before or back is None:
            why["unknown"] += 1
        else:
            why["left at a take" if back <= before[-1] else "back after its take"] += 1
    return why


def bursts(lines: list[dict]) -> list[int]:
    """Sizes of the runs of groups that came back within BURST_S of each other (2 or more)."""
    times = sorted(g["returned_at"] for g in lines if g["event"] == "returned" and g.get("returned_at") is not None)
    sizes, run = [], 1
    for a, b in zip(times, times[1:]):
        if b - a <= BURST_S:
            run += 1
        else:
            if run > 1:
                sizes.append(run)
            run = 1
    return sizes + ([run] if run > 1 else [])


def report(lines: list[dict]) -> str:
    bs = batches(lines)
    t0 = min(g["time"] for g in lines)
    rows = ["| cycle | taken at (s) | groups | versions | mean tokens a group | hand-out to return (s), median / max |",
            "| --: | --: | --: | --- | --: | --: |"]
    for b in bs:
        at = "" if b["taken_at"] is None else f"{b['taken_at'] - t0:.2f}"
        versions = ", ".join(f"{v}: {n}" for v, n in sorted(b["versions"].items()))
        took = f"{median(b['sampling_s']):.2f} / {max(b['sampling_s']):.2f}" if b["sampling_s"] else ""
        rows.append(f"| {b['cycle']} | {at} | {b['groups']} | {versions} | {b['tokens'] / max(b['groups'], 1):.0f} "
                    f"| {took} |")
    events = Counter(g["event"] for g in lines)
    why = dropped_why(lines)
    burst = bursts(lines)
    rows += ["", "events: " + ", ".join(f"{k} {v}" for k, v in sorted(events.items())),
             "dropped: " + (", ".join(f"{k} {v}" for k, v in sorted(why.items())) or "none"),
             f"bursts (back within {BURST_S * 1000:.0f} ms of each other): {len(burst)}, sizes {sorted(burst)}"]
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    print(report(read_lines(ap.parse_args().trace)))  # a line a crash cut short left out


if __name__ == "__main__":
    main()
