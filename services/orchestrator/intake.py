"""Intake: what the rollout workers hand back, sorted (docs/grpo.md §6). A scored group goes into the buffer (or is
filtered out by dynamic sampling); a group stopped or dropped past the staleness bound, a reward function that failed
and a dead worker's prompts are handed out again once; the second time of each, and a group without any reward, are
recorded in failed_prompts.jsonl (the FailureLog). Every prompt handed out ends in one of these: never lost, never
trained twice."""

from __future__ import annotations

import time
from collections import Counter

from tandem.core.engine_memory import oversample_prompts
from tandem.core.errors import RewardContractError
from tandem.services.orchestrator.failures import FailureLog
from tandem.services.orchestrator.group_buffer import GroupBuffer
from tandem.services.orchestrator.prompt_source import PromptSource
from tandem.services.orchestrator.rollout_pool import lost_object
from tandem.services.orchestrator.run_log import RunLog


class Intake:
    def __init__(self, cfg, source: PromptSource, buffer: GroupBuffer, failures: FailureLog, log: RunLog,
                 counters: Counter):
        self.cfg, self.source, self.buffer, self.failures, self.log = cfg, source, buffer, failures, log
        self.counters = counters  # the controller's, saved with its state

    def accept(self, it, meta: dict, ref, version: int, all_taken: bool) -> None:
        """One prompt's result from a worker (meta: group_meta), at policy `version`; all_taken: the run's last batch
        is taken (a stopped group is left for a resume)."""
        if meta.get("stale_version") is not None:  # stopped mid-sampling
            self.log.group("left" if all_taken else "stopped", version, it.index, it.epoch, meta["stale_version"],
                           handed_out_at=it.queued_at)
            if all_taken:  # by the run's end: left for a resume (the checkpoint's source state)
                self.source.requeue(it.index, it.epoch)
            else:  # it could not be trained any more
                self.counters["stale_stopped"] += 1
                self._stale(it.index, it.epoch, version, meta["stale_version"])
        elif not meta.get("failure"):
            self.failures.rewarded()
            times = {"handed_out_at": it.queued_at, "returned_at": time.time()}  # run_log.sampling_times
            admitted = self.buffer.admit(dict(meta, index=it.index, epoch=it.epoch, **times), ref)
            self.log.group("returned" if admitted else "filtered", version, it.index, it.epoch, meta["version"],
                           tokens=meta.get("tokens"), **times, **in_flight_versions(meta))
            if not admitted:
                self.counters["groups_filtered"] += 1
                self.counters["filtered_tokens"] += meta.get("tokens", 0)
        elif meta.get("fatal"):  # the function's answer has the wrong shape: every other row would fail the same way
            raise RewardContractError(meta["failure"])
        elif meta.get("no_reward"):  # the functions' answer, not a failure: recorded at once, never retried
            self.counters["groups_no_reward"] += 1
            self.failures.no_reward(it.index, it.epoch, meta["failure"])
        else:
            self.counters["reward_failures"] += 1
            if not self.source.retry(it.index, it.epoch):
                self.failures.reward_error(it.index, it.epoch, meta["failure"])

    def lost(self, items: list) -> None:
        """Prompts a dead worker held: back to the front of the queue, or, the second time, failed (nothing lost)."""
        for it in items:
            if not self.source.died_with_worker(it.index, it.epoch):
                self.counters["worker_died_prompts"] += 1
                self.failures.worker_died(it.index, it.epoch, f"the rollout worker died twice while running dataset "
                                          f"row {it.index} (the second time with no other prompt)")

    def without_lost(self, batch: list, ray, say) -> None:
        """A batch whose training could not fetch some of its groups (lost with their node): those prompts to the
        front of the queue (sampled again: nothing was trained on them), the groups still there back at the buffer's
        front."""
        kept, lost = [], []
        for m, ref in batch:
            try:
                ray.get(ref, timeout=30)
                kept.append((m, ref))
            except ray.exceptions.RayError as e:
                if not lost_object(e):
                    raise
                lost.append(m)
        for m in lost:
            self.source.requeue(m["index"], m["epoch"], front=True)
        self.counters["groups_lost"] += len(lost)
        say(f"tandem: {len(lost)} scored group(s) lost with their node (dataset rows {sorted(m['index'] for m in lost)})"
            f": sampled again; nothing was trained on them")
        self.buffer.groups[:0] = kept

    def drop_stale(self, version: int) -> None:
        """Buffered groups past the staleness bound at `version` dropped, their prompts handed out again."""
        for m in self.buffer.drop_stale(version):
            self.counters["stale_dropped"] += 1
            self.counters["stale_dropped_tokens"] += m.get("tokens", 0)
            self.log.group("dropped", version, m["index"], m["epoch"], m["version"], tokens=m.get("tokens"),
                           returned_at=m.get("returned_at"))
            self._stale(m["index"], m["epoch"], version, m["version"])

    def _stale(self, index: int, epoch: int, version: int, sampled: int) -> None:
        """A group past the staleness bound (stopped mid-sampling, or dropped from the buffer when it came back too
        late): its prompt sampled again once in its epoch, the second time recorded as not trained (the source
        counts)."""
        if not self.source.went_stale(index, epoch, version):
            self.counters["stale_failed"] += 1
            self.failures.too_slow(index, epoch, version - sampled, self.cfg.cluster.max_staleness,
                                   oversample_prompts(self.cfg))


def in_flight_versions(meta: dict) -> dict:
    """A group's versions for its trace line where a publish reached it while sampling: the one it started on, and
    each completion's versions (those that sampled its tokens)."""
    if "completion_versions" not in meta:
        return {}
    return {"first_version": meta["first_version"], "completion_versions": meta["completion_versions"]}
