"""metrics.jsonl (the record: one line per optimizer step) and the Ray metrics the dashboard plots."""

from __future__ import annotations

import json
from pathlib import Path

# metrics of the last optimizer step of each cycle exported as Ray metrics (the dashboard's Metrics
# page; Prometheus scrapes them as ray_<series_name>; deploy/grafana/tandem.json plots them)
EXPORTED = ("reward", "reward_std", "kl", "clip_ratio/region_mean", "completion_length", "loss", "entropy",
            "publish_latency_s", "queue_depth", "prompts_in_flight", "rollout/gen_tokens_per_s",
            "rollout/busy_frac", "learner/tokens_per_s", "learner/mfu", "version")


def series_name(key: str) -> str:
    return "tandem_" + key.replace("/", "_")


class RunLog:
    def __init__(self, path: Path):
        self.path = path
        self._gauges: dict = {}

    def write(self, steps: list[dict]) -> None:
        with open(self.path, "a") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")
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
        except Exception:  # noqa: BLE001 - the dashboard is optional, the JSONL is the record
            pass
