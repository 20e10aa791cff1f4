"""The end-of-run plot: reward (mean ± std, eval reward when evaluated), KL, clip fraction, completion length
per step."""

from __future__ import annotations

from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """The lines of metrics.jsonl, less one a crash cut short (the resume that follows names and drops it)."""
    from tandem.services.orchestrator.run_log import parse_lines

    return parse_lines(Path(path).read_text())


def plot_run(metrics_path: str | Path, out_png: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    everything = read_metrics(metrics_path)
    rows = [r for r in everything if "reward" in r]  # training steps (step 0 of eval_on_start has none)
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(10, 6.5))
    rew = [r["reward"] for r in rows]
    std = [r.get("reward_std", 0.0) for r in rows]
    ax[0, 0].plot(steps, rew, color="C0")
    ax[0, 0].fill_between(steps, [a - b for a, b in zip(rew, std)], [a + b for a, b in zip(rew, std)],
                          color="C0", alpha=0.2)
    ev = [(r["step"], r["eval/reward"]) for r in everything if "eval/reward" in r]
    if ev:
        ax[0, 0].plot(*zip(*ev), "o-", color="C4", label="eval")
        ax[0, 0].legend(loc="lower right")
    ax[0, 0].set_title("reward (mean ± std)" + (", eval reward" if ev else ""))
    ax[0, 1].plot(steps, [r.get("kl", 0.0) for r in rows], color="C1")
    ax[0, 1].set_title("KL to reference" if any("kl" in r for r in rows) else "KL (beta = 0: not computed)")
    ax[1, 0].plot(steps, [r.get("clip_ratio/region_mean", 0.0) for r in rows], color="C2")
    ax[1, 0].set_title("clip fraction")
    ax[1, 1].plot(steps, [r.get("completion_length", 0.0) for r in rows], color="C3")
    ax[1, 1].set_title("completion length (tokens)")
    for a in ax.flat:
        a.set_xlabel("optimizer step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return Path(out_png)
