"""What became of a run's groups, from its group_trace.jsonl (logging.group_trace; the GPU bench keeps one beside each
Tandem run's JSON as NAME-groups.jsonl): a line per batch, why each group dropped past the bound was dropped, and
what became of each prompt (trained at its first try, after being sampled again, or past the bound twice), and what
became of the groups in flight at each take (at max_staleness 1, the outstanding prompts the bound lets out are two
batches; those held by groups the bound will stop are not sampling the next batch).

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
                                           "versions": Counter(), "tokens": 0, "sampling_s": [], "handed_out": []})
            b["groups"] += 1
            b["versions"][g["version"]] += 1
            b["tokens"] += g.get("tokens") or 0
            r = back.get((g["epoch"], g["index"], g["version"]), {})
            if r.get("handed_out_at") is not None and r.get("returned_at") is not None:
                b["sampling_s"].append(r["returned_at"] - r["handed_out_at"])
                b["handed_out"].append(r["handed_out_at"])
    out = [by[c] for c in sorted(by)]
    for prev, b in zip(out, out[1:]):  # its groups handed out after the take before it (None: times not known)
        b["handed_after_last_take"] = None if prev["taken_at"] is None else sum(
            h > prev["taken_at"] for h in b["handed_out"])
    return out


def attempts(lines: list[dict]) -> list[tuple]:
    """Each hand-out of a prompt whose end the trace has: (handed out at, ended at, how, (epoch, index, version)),
    how: 'returned', 'stopped' or 'left'."""
    out = []
    for g in lines:
        at = g.get("handed_out_at")
        if at is None:
            continue
        if g["event"] == "returned" and g.get("returned_at") is not None:
            out.append((at, g["returned_at"], "returned", (g["epoch"], g["index"], g["version"])))
        elif g["event"] in ("stopped", "left"):
            out.append((at, g["time"], g["event"], (g["epoch"], g["index"], g["version"])))
    return out


def in_flight_at_takes(lines: list[dict]) -> list[tuple[int, Counter]]:
    """For each take: the groups in flight at that moment by what became of them (trained, dropped, stopped, left,
    or 'buffered at the end')."""
    fate = {(g["epoch"], g["index"], g["version"]): g["event"] for g in lines if g["event"] in ("trained", "dropped")}
    runs = attempts(lines)
    out = []
    for b in batches(lines):
        if b["taken_at"] is None:
            continue
        t = b["taken_at"]
        out.append((b["cycle"], Counter(fate.get(key, "buffered at the end") if how == "returned" else how
                                        for at, end, how, key in runs if at <= t < end)))
    return out


def drops(lines: list[dict]) -> list[tuple[str, float | None]]:
    """Each dropped group: (why: 'left at a take', back before the last take before its drop, or 'back after its
    take'; for one back after its take, the milliseconds after it: a few where the take fell inside a burst of groups
    coming back)."""
    takes = sorted({b["taken_at"] for b in batches(lines) if b["taken_at"] is not None})
    out = []
    for g in lines:
        if g["event"] != "dropped":
            continue
        before = [t for t in takes if t <= g["time"]]
        back = g.get("returned_at")
        if not before or back is None:
            out.append(("unknown", None))
        elif back <= before[-1]:
            out.append(("left at a take", None))
        else:
            out.append(("back after its take", (back - before[-1]) * 1000))
    return out


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


def prompt_outcomes(lines: list[dict]) -> Counter:
    """Each prompt (epoch, index) of the trace by what became of it: trained at its first try, trained after its group
    went past the bound (stopped or dropped) and the prompt was sampled again, past the bound twice (the second time
    recorded as not trained), left at the run's end (stopped by the last batch's take), or still out at the end."""
    seen: dict = {}
    for g in lines:
        if g["event"] in ("stopped", "dropped", "trained", "left"):
            seen.setdefault((g["epoch"], g["index"]), []).append(g["event"])
    out = Counter()
    for events in seen.values():
        past = sum(e in ("stopped", "dropped") for e in events)
        if "trained" in events:
            out["trained at the first try" if not past else "trained after being sampled again"] += 1
        elif past >= 2:
            out["past the bound twice"] += 1
        elif "left" in events:
            out["left at the run's end"] += 1
        else:
            out["past the bound once, out at the end"] += 1
    return out


def stopped_after(lines: list[dict]) -> list[float]:
    """Seconds from each stopped group's hand-out to its stop: the window the staleness bound gave it."""
    return [g["time"] - g["handed_out_at"] for g in lines if g["event"] == "stopped" and g.get("handed_out_at")]


def report(lines: list[dict]) -> str:
    bs = batches(lines)
    t0 = min(g["time"] for g in lines)
    flight = dict(in_flight_at_takes(lines))
    rows = ["| cycle | taken at (s) | groups | versions | mean tokens a group | hand-out to return (s), median / max "
            "| handed out after the take before | in flight at the take, by fate |",
            "| --: | --: | --: | --- | --: | --: | --: | --- |"]
    for b in bs:
        at = "" if b["taken_at"] is None else f"{b['taken_at'] - t0:.2f}"
        versions = ", ".join(f"{v}: {n}" for v, n in sorted(b["versions"].items()))
        took = f"{median(b['sampling_s']):.2f} / {max(b['sampling_s']):.2f}" if b["sampling_s"] else ""
        after = b.get("handed_after_last_take")
        fates = ", ".join(f"{k} {v}" for k, v in sorted(flight.get(b["cycle"], Counter()).items()))
        rows.append(f"| {b['cycle']} | {at} | {b['groups']} | {versions} | {b['tokens'] / max(b['groups'], 1):.0f} "
                    f"| {took} | {'' if after is None else after} | {fates} |")
    events = Counter(g["event"] for g in lines)
    dropped = drops(lines)
    why, after = Counter(w for w, _ in dropped), [ms for _, ms in dropped if ms is not None]
    burst = bursts(lines)
    rows += ["", "events: " + ", ".join(f"{k} {v}" for k, v in sorted(events.items())),
             "dropped: " + (", ".join(f"{k} {v}" for k, v in sorted(why.items())) or "none")
             + (f" (ms after the take: {sorted(round(ms) for ms in after)})" if after else ""),
             f"bursts (back within {BURST_S * 1000:.0f} ms of each other): {len(burst)}, sizes {sorted(burst)}",
             "prompts: " + ", ".join(f"{k} {v}" for k, v in sorted(prompt_outcomes(lines).items()))]
    if windows := stopped_after(lines):
        rows.append(f"stopped after (s, from hand-out): median {median(windows):.1f}, min {min(windows):.1f}, "
                    f"max {max(windows):.1f}")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    print(report(read_lines(ap.parse_args().trace)))  # a line a crash cut short left out


if __name__ == "__main__":
    main()
