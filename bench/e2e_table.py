"""The end-to-end benchmark's table: each candidate's figures, the ratios against the peer, the pipeline's
efficiencies, and what was wasted."""

from __future__ import annotations

import json
from pathlib import Path


def versions() -> dict:
    out = {}
    for name in ("torch", "vllm", "ray", "deepspeed", "trl", "transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - not installed here
            pass
    return out


def pipeline_efficiency(run: dict, synchronous: dict | None) -> float | None:
    """A candidate's seconds a step over the larger of the step's generation alone and its training alone, both
    from the same workload's `max_staleness: 0` run (Tandem's, where neither overlaps the other): 1.0 is a
    pipeline with no bubble; a synchronous loop is near the sum over the larger."""
    if not synchronous or not synchronous.get("generate_wait_s") or not synchronous.get("train_s_per_step"):
        return None
    return run["s_per_step"] / max(synchronous["generate_wait_s"], synchronous["train_s_per_step"])


def pipeline_efficiency_tokens(run: dict, synchronous: dict | None) -> float | None:
    """The same counted in trained completion tokens: the `max_staleness: 0` run's tokens a step over the larger of
    its generation alone and its training alone, against the candidate's tokens a second. An asynchronous batch takes
    the groups that finish first, so in a short run it trains shorter completions than a synchronous one, and its
    step time alone reads better than its work; the tokens do not depend on that mix. Equal to pipeline_efficiency
    for the `max_staleness: 0` run itself."""
    if pipeline_efficiency(run, synchronous) is None or not run.get("gen_tokens_per_s") \
            or not synchronous.get("gen_tokens_per_s"):
        return None
    per_step = synchronous["gen_tokens_per_s"] * synchronous["s_per_step"]
    alone = per_step / max(synchronous["generate_wait_s"], synchronous["train_s_per_step"])
    return alone / run["gen_tokens_per_s"]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing (or b is 0)."""
    return a / b if a and b else None


def sharing_speeds(run: dict, synchronous: dict | None) -> dict:
    """What sharing the device costs each side, against the `max_staleness: 0` run (where each runs alone): the
    engine's trained tokens a second of its busy time (tokens a second over the share of the run it had requests),
    and the learner's forwards' speed, each as a share of its speed alone (1.0: no slowdown). Their sum is what the
    pair gets out of the device: 2.0 would be two devices."""
    if not synchronous or run is synchronous:
        return {}
    busy = lambda r: ratio(r.get("gen_tokens_per_s"), r.get("rollout_busy_frac"))  # noqa: E731
    return {"engine_x_alone": ratio(busy(run), busy(synchronous)),
            "learner_x_alone": ratio(synchronous.get("learner_forwards_s"), run.get("learner_forwards_s"))}


ASYNC_PEER = "trl_async"  # the asynchronous baseline: its column leads the table's ratios


def stale_counts(run: dict) -> str:
    """A Tandem run's groups stopped past max_staleness, dropped past it, and prompts recorded for it (None: a counter
    that never moved, 0); — for a count the run's JSON does not have (a peer's, or one recorded before it was)."""
    keys = ("stale_stopped", "stale_dropped", "stale_failed")
    if not any(k in run for k in keys):
        return "—"
    counts = " / ".join(str(int(run[k] or 0)) if k in run else "—" for k in keys)
    waste = run.get("stale_waste_frac")  # the engines' work they took over the run (recorded since 2026-12-06)
    return counts if waste is None else f"{counts} ({waste:.0%} of the engine)"


def pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def table(out_dir: Path, names: list[str], ceiling: str | None, peer: str,
          k0: Path | None = None, elsewhere: dict[str, Path] | None = None) -> tuple[str, dict]:
    """k0: the `max_staleness: 0` run the efficiencies are read against, where it is not among these (another
    call's run of the same workload on the same card: the results page says which). elsewhere: {candidate: JSON}
    run in another call (the same workload and card kind), a row marked † (its ratios span two calls)."""
    elsewhere = elsewhere or {}
    c = {n: json.loads((out_dir / f"{n}.json").read_text()) for n in names if (out_dir / f"{n}.json").is_file()}
    c.update({n: json.loads(Path(p).read_text()) for n, p in elsewhere.items()})
    synchronous = json.loads(k0.read_text()) if k0 else c.get("tandem_k0")
    for r in c.values():
        r["pipeline_efficiency"] = pipeline_efficiency(r, synchronous)
        r["pipeline_efficiency_tokens"] = pipeline_efficiency_tokens(r, synchronous)
        r.update(sharing_speeds(r, synchronous))
    fmt = lambda v, p=2: "—" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
    cpu = any(r.get("pss_gb") is not None for r in c.values())  # CPU: memory as PSS, launch time, cores
    extra = " launch → first step s | peak PSS GB | cores > 50% |" if cpu else ""
    # gen tok/s: completion tokens trained a second, as each candidate counts them (the tokens' ratio beside the
    # completions': the candidates may train different mixes of lengths)
    lines = ["| candidate | s/step | gen s/step | train s/step | pipeline efficiency | (by tokens) | engine × alone "
             "| learner × alone | completions/s | × " + ASYNC_PEER + " | × " + peer + " | gen tok/s | tok × " + ASYNC_PEER
             + " | × ceiling | GPU busy | peak GPU GiB | publish s | stale stopped / dropped / failed | wasted "
             "| trained tok / completion | lag mean / max | updated in flight |" + extra,
             "|" + " --- |" * (25 if cpu else 22)]
    for n, r in c.items():
        x_peer = r["completions_per_s"] / c[peer]["completions_per_s"] if peer in c else None
        x_async = r["completions_per_s"] / c[ASYNC_PEER]["completions_per_s"] if ASYNC_PEER in c else None
        tok_async = ratio(r.get("gen_tokens_per_s"), c.get(ASYNC_PEER, {}).get("gen_tokens_per_s"))
        x_ceil = (r["gen_tokens_per_s"] / c[ceiling]["gen_tokens_per_s"]
                  if ceiling in c and r.get("gen_tokens_per_s") and n != ceiling else None)
        row = (f"| {n}{' †' if n in elsewhere else ''} | {fmt(r['s_per_step'], 3)} | {fmt(r.get('gen_s_per_step'))} | "
               f"{fmt(r.get('train_s_per_step'))} | {fmt(r.get('pipeline_efficiency'))} | "
               f"{fmt(r.get('pipeline_efficiency_tokens'))} | "
               f"{fmt(r.get('engine_x_alone'))} | {fmt(r.get('learner_x_alone'))} | "
               f"{fmt(r['completions_per_s'], 1)} | {fmt(x_async)} | {fmt(x_peer)} | "
               f"{fmt(r.get('gen_tokens_per_s'), 0)} | {fmt(tok_async)} | {fmt(x_ceil)} | "
               f"{fmt(r.get('gpu_busy_frac'))} | "
               f"{fmt(r.get('peak_gpu_gib'), 1)} | {fmt(r.get('publish_latency_s'), 3)} | {stale_counts(r)} | "
               f"{pct(r.get('wasted_frac'))} | {fmt(r.get('trained_tokens_per_completion'), 0)} | "
               f"{fmt(r.get('version_lag_mean'))} / {fmt(r.get('version_lag_max'), 0)} | "
               f"{fmt(r.get('inflight_updated'), 0)} |")
        if cpu:
            row += (f" {fmt(r.get('launch_to_first_step_s'), 1)} | {fmt(r.get('pss_gb'))} |"
                    f" {fmt(r.get('cores_busy'))} |")
        lines.append(row)
    lines += [f"† {n}: {p}" for n, p in elsewhere.items()]
    return "\n".join(lines), c


