"""metrics.jsonl (the record: one line per optimizer step) and the Ray metrics the dashboard plots."""

from __future__ import annotations

import json
import re
import statistics
import time
from collections import Counter
from pathlib import Path

# metrics of the last optimizer step of each cycle exported as Ray metrics (the dashboard's Metrics
# page; Prometheus scrapes them as ray_<series_name>; deploy/grafana/tandem.json plots them)
EXPORTED = ("reward", "reward_std", "kl", "clip_ratio/region_mean", "completion_length", "loss", "entropy",
            "publish_latency_s", "queue_depth", "prompts_in_flight", "rollout/gen_tokens_per_s",
            "rollout/busy_frac", "rollout/stale_waste_frac", "rollout/sampled_ahead_frac", "learner/tokens_per_s",
            "learner/mfu", "version", "eval/reward", "eval/reward_std", "eval/completion_length")


FLAT_STEPS = 10  # steps in a row without reward variance before the run says so


def series_name(key: str) -> str:
    return "tandem_" + key.replace("/", "_")


def rollout_rates(start: dict, after: dict) -> dict:
    """Per-cycle rollout figures from two snapshots of the workers' stats ({worker: {tokens, busy_s,
    stale_sequence_steps}} and the time `t` each was taken): generated tokens per second of engine busy time (summed
    over workers), the share of the cycle an engine was busy (mean over workers), the longest busy time, the
    share of the engines' work that no training took: the sequence steps of requests stopped past max_staleness and
    the tokens of finished groups dropped past it in the buffer (`dropped_tokens`, the controller's count), over those
    steps and the tokens of the groups that finished (an upper bound: a stopped sequence may have ended before), and for
    streaming engines their steps a second of busy time and the sequences a step carried (a group's tokens count in
    the cycle it finishes: over a cycle, an estimate)."""
    wall = max(after["t"] - start["t"], 1e-9)
    rates, fracs, busiest, tokens, stale = {}, {}, 0.0, 0, 0
    steps, stepping, carried = 0, 0.0, 0  # the streaming engines': steps, their busy time, sequence steps
    for w, s in after["workers"].items():
        b = start["workers"].get(w, {"tokens": 0, "busy_s": 0.0})
        busy, made = s["busy_s"] - b["busy_s"], s["tokens"] - b["tokens"]
        rates[w] = made / busy if busy > 0 else 0.0
        fracs[w] = busy / wall
        busiest = max(busiest, busy)
        wasted = s.get("stale_sequence_steps", 0) - b.get("stale_sequence_steps", 0)
        tokens, stale = tokens + made, stale + wasted
        if n := s.get("engine_steps", 0) - b.get("engine_steps", 0):  # a streaming engine's (vLLM's)
            steps, stepping, carried = steps + n, stepping + busy, carried + made + wasted
    # a dropped group finished in this cycle or an earlier one: over one cycle the share is capped at all of it
    dropped = after.get("dropped_tokens", 0) - start.get("dropped_tokens", 0)
    out = {"rollout/gen_tokens_per_s": sum(rates.values()),
           "rollout/busy_frac": sum(fracs.values()) / len(fracs) if fracs else 0.0, "rollout_busy_s": busiest,
           "rollout/stale_waste_frac": min(1.0, (stale + dropped) / (stale + tokens)) if stale + tokens > 0 else 0.0}
    if steps:  # how fast the engines step, and how many sequences a step carries (finished tokens and stopped steps)
        out.update({"rollout/engine_steps_per_s": steps / stepping if stepping > 0 else 0.0,
                    "rollout/sequences_per_step": carried / steps})
    out.update({f"rollout/{w}/gen_tokens_per_s": r for w, r in rates.items()})
    out.update({f"rollout/{w}/busy_frac": f for w, f in fracs.items()})
    return out


def sampling_times(metas: list[dict], last_take: float | None = None) -> dict:
    """How long a batch's groups took from their hand-out to their return to the controller: a group's (the median
    over the batch), and the batch's, from its first hand-out to its last return; and how long a group waited in the
    buffer from its return to the batch's take (the median), holding a place of the staleness bound meanwhile.
    Beside the cycle's split they say whether a step waits on the engine's speed or on when the prompts went out
    (docs/evaluation-and-metrics.md). last_take: when the batch before this one was taken; the share of this batch's
    groups handed out before it (`rollout/sampled_ahead_frac`) is how much of it was sampled while that batch trained:
    at max_staleness >= 1 near 0 means the batch was sampled after the training, not beside it. Groups without the
    times are left out."""
    spans = [(m["handed_out_at"], m["returned_at"]) for m in metas if m.get("handed_out_at") and m.get("returned_at")]
    if not spans:
        return {}
    out = {"rollout/group_sampling_s": statistics.median(b - a for a, b in spans),
           "rollout/batch_sampling_s": max(b for _, b in spans) - min(a for a, _ in spans)}
    if last_take is not None:
        out["rollout/sampled_ahead_frac"] = sum(a < last_take for a, _ in spans) / len(spans)
    if waits := [m["taken_at"] - m["returned_at"] for m in metas if m.get("returned_at") and m.get("taken_at")]:
        out["rollout/group_buffered_s"] = statistics.median(waits)
    return out


def parse_lines(text: str) -> list[dict]:
    """metrics.jsonl's lines as dicts, less one a crash cut short (the resume that follows names and drops it)."""
    out = []
    for x in text.splitlines():
        try:
            out.append(json.loads(x))
        except ValueError:
            pass
    return out


def read_lines(path) -> list[dict]:
    """parse_lines of a metrics file; none where there is no file yet."""
    p = Path(path)
    return parse_lines(p.read_text()) if p.is_file() else []

class RunLog:
    """`trackers` (services/orchestrator/trackers.py, started with the job) get each line after metrics.jsonl."""

    def __init__(self, path: Path, group_trace: bool = False):
        self.path = path
        self.trackers = None
        self.mirror = None  # the run files' copy at a storage URI (tandem.core.storage.RunMirror), set at setup
        # logging.group_trace: what became of each group, a line each, written with the step's metrics
        self.group_trace = path.with_name("group_trace.jsonl") if group_trace else None
        self._groups: list[dict] = []
        self._gauges: dict = {}
        self._export_failed = False
        self._flat = 0  # steps in a row whose every group had zero reward variance
        self.cut: list[str] = []  # the lines a crash cut short that the last cut_back dropped

    def cut_back(self, step: int) -> int:
        """On resume: lines of steps after the checkpoint's are dropped (they are trained again), and so is a
        line a crash cut short, each of those named in `self.cut` (the terminal shows it). -> lines dropped."""
        self.cut = []
        if not self.path.is_file():
            return 0
        lines, keep = self.path.read_text().splitlines(), []
        for n, x in enumerate(lines, 1):
            try:
                if json.loads(x).get("step", 0) <= step:
                    keep.append(x)
            except ValueError:
                if x.strip():
                    s = step_of(x)
                    self.cut.append(f"{self.path} line {n} was cut short (a crash while writing it) and is dropped: "
                                    f"{x[:60]!r}" + ("" if s is None or s > step else
                                                     f"; step {s} was trained and keeps no metrics line"))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        tmp.replace(self.path)
        return len(lines) - len(keep)

    def lines(self) -> list[dict]:
        """The lines written, less one a crash cut short."""
        return read_lines(self.path)

    def has_step(self, step: int) -> bool:
        if not self.path.is_file():
            return False
        return any(json.loads(x).get("step") == step for x in self.path.read_text().splitlines() if x.strip())

    def group(self, event: str, served: int, index: int, epoch: int, version: int | None, **more) -> None:
        """A line of group_trace.jsonl (logging.group_trace): `event` returned (scored, buffered), filtered
        (dynamic sampling), trained (its batch's training ended; `cycle`), stopped (mid-sampling, past
        max_staleness), dropped (buffered, then past it), or left (stopped by the run's last batch, pending for a
        resume); `served`: the newest version published then; `version`: the one that sampled it."""
        if self.group_trace is not None:
            self._groups.append({"time": time.time(), "event": event, "served": served, "index": index,
                                 "epoch": epoch, "version": version, **more})

    def push(self) -> None:
        """The run files written since the last push to the storage URI (none for a local output_dir)."""
        if self.mirror:
            self.mirror.push()

    def flush_groups(self) -> None:
        if self._groups:
            with open(self.group_trace, "a") as f:
                f.write("".join(json.dumps(g) + "\n" for g in self._groups))
            self._groups = []

    def write(self, steps: list[dict]) -> None:
        for st in steps:
            self._flat = self._flat + 1 if st.get("frac_reward_zero_std") == 1.0 else 0
            if self._flat == FLAT_STEPS:
                print(f"tandem: warning: every group's completions got the same reward for {FLAT_STEPS} steps in a "
                      f"row (to step {st.get('step')}): the advantages are 0 and nothing is learned; check the reward "
                      "functions (or grpo.dynamic_sampling: true to skip such groups)", flush=True)
        self.flush_groups()
        now = time.time()
        lines = [{"time": now, **s} for s in steps]
        with open(self.path, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        if self.trackers is not None:
            self.trackers.log(lines)
        try:
            from ray.util.metrics import Gauge

            for key in EXPORTED:
                v = steps[-1].get(key)
                if v is None:
                    continue
                name = series_name(key)
                if name not in self._gauges:
                    self._gauges[name] = Gauge(name, description=f"Tandem {key} per optimizer step")
                self._gauges[name].set(float(v))
        except Exception as e:  # noqa: BLE001 - the dashboard is optional, the JSONL is the record: said once
            if not self._export_failed:
                self._export_failed = True
                print(f"tandem: the Ray metrics of step {steps[-1].get('step')} could not be exported "
                      f"({type(e).__name__}: {e}); metrics.jsonl has them", flush=True)


def cycle_lines(steps: list[dict], metas: list[dict], version: int, before: dict, now: dict, counters, last_take,
                figures: dict) -> list[dict]:
    """A cycle's metrics lines: each optimizer step's, with the cycle's `figures` (stage times, queue, workers: the
    controller's), the lag of the batch's groups behind the version published after them (`staleness_hist`), the
    rollout rates between the workers' snapshots `before` and `now`, the wasted fraction, the counters, the
    episodes' metrics and the sampling times of the batch's groups (`metas`)."""
    from tandem.rollout.episodes import episode_metrics

    lags = Counter(version - 1 - m["version"] for m in metas)
    extra = {**figures, "cluster/scale_events": counters["scale_events"],
             "staleness_hist": {str(k): v for k, v in sorted(lags.items())},
             **rollout_rates(before, now), "rollout/wasted_frac": wasted_frac(counters, now),
             **{f"count/{k}": v for k, v in counters.items()},
             **episode_metrics([m.get("episodes") for m in metas]), **sampling_times(metas, last_take)}
    return [dict(s, **extra) for s in steps]


def step_of(line: str) -> int | None:
    """The step number of a metrics line, even a cut one ('{"time": 17.5, "step": 7, "re' -> 7)."""
    m = re.search(r'"step":\s*(\d+)[,}]', line)
    return int(m.group(1)) if m else None


def wasted_frac(counters, stats: dict) -> float:
    """rollout/wasted_frac, over the run so far (the controller's counters, its workers' stats): the tokens sampled
    that no training took (stopped mid-sampling for staleness, dropped past the bound, filtered by dynamic sampling,
    masked as too old in a trained group) over every token sampled into a group that was trained or thrown away (those
    buffered or sampling are neither yet)."""
    stopped = sum(w.get("stale_sequence_steps", 0) for w in stats["workers"].values())
    lost = stopped + counters["stale_dropped_tokens"] + counters["filtered_tokens"]
    sampled = lost + counters["trained_group_tokens"]
    return (lost + counters["stale_masked_tokens"]) / sampled if sampled else 0.0
