"""How far the rollout side may run ahead of the learner: pure arithmetic of `cluster.max_staleness` (k).

Versions: the learner at version t trains one batch of U = unique_prompts groups and makes t + 1, which the workers
then serve. A group sampled with version s may be trained by a learner at version t only if t - s <= k
(services/orchestrator/group_buffer.py drops the others and samples their prompts again).

A prompt handed out now is sampled with the version served now, v, or a newer one. Batches are taken oldest version
first (GroupBuffer.take), so the prompts outstanding (buffered or in flight) fill the next batches in order. While no
batch is in training, the learner is at v: the next take trains at v, the one after at v + 1, ..., so k + 1 batches
may be outstanding (the k-th trains at v + k: a lag of k). While a batch is in training (taken, making v + 1), the
batches after it train at v + 1 ... v + k: k of them. Handing out fewer leaves the engine idle before the bound;
more, and the groups past the bound are sampled only to be dropped.

At the run's end, at most one batch of prompts past its last (k >= 1). A batch takes the groups that finish first, so
the longest completions slide to later batches; a last batch whose prompts were only its own would wait for every
one of them (on one H200, the 1.5B long tail's last steps took 12-21 s against 4-9 s before them). With one batch
more out, it takes the first to finish, as any other batch; taking it stops the rest (the controller's
_start_training), which no training in this run takes: the run's last checkpoint holds their prompts as pending, and
a resume with more steps hands them out first. TRL's AsyncGRPOTrainer likewise stops its rollout worker when training
ends and leaves what it did not train.
"""

from __future__ import annotations


def prompts_wanted(unique_prompts: int, max_staleness: int, training: bool, batches_left: int,
                   oversample: int = 0) -> int:
    """Prompts to keep outstanding (buffered + in flight) now. training: a batch is taken and not yet trained;
    batches_left: the run's batches not yet trained, that one included; oversample: prompts out beyond the bound
    (cluster.rollout_oversample_prompts, k >= 1), which the takes' stops balance. Once every batch is taken, none."""
    untaken = batches_left - int(training)
    if untaken <= 0:
        return 0
    return unique_prompts * min(max_staleness + 1 - int(training), untaken + int(max_staleness >= 1)) + oversample


def trained_ahead_allowed(max_staleness: int, batches_left: int, checkpoint_due: bool, stopping: bool) -> bool:
    """Whether the next batch may start training before this cycle's bookkeeping (publish wait, metrics, record, the
    driver's next call): with max_staleness >= 1 its groups need not wait for the version being published, and the
    learner then never idles between batches. Not when this cycle saves a checkpoint (the save must hold this cycle's
    weights, and the learner runs its calls in order), past the last batch, or when the job is stopping."""
    return max_staleness >= 1 and batches_left > 0 and not checkpoint_due and not stopping


# Groups that finish on one engine step (long ones all stopped by max_completion_length, say) come back a few
# milliseconds apart, each scored on its own. A take that falls inside such a burst took fresher groups that the
# next batch could have taken, and the burst's older groups that came back just after it were dropped past the bound:
# every finished group dropped at max_staleness 1 in the 1.5B long tail's group traces came back 1-13 ms after a take
# (bench/results/e2e_gpu_scale.md, 2026-12-07). So a take that may matter waits for the rest of a burst: polls of
# BURST_GAP_S while groups keep coming back, BURST_MAX_S in all.
BURST_GAP_S = 0.02
BURST_MAX_S = 0.1


def burst_may_matter(buffered: list[int], in_flight: list[int], take: int, only_this_batch: int) -> bool:
    """Whether a group still in flight could displace one that the take is about to include: some in-flight group
    was sampled with `only_this_batch` (the oldest version this batch may take, which the next cannot), and the
    `take` oldest buffered groups (what GroupBuffer.take takes) include one the next batch could take (a newer
    version). buffered: the buffered groups' versions; in_flight: the versions the in-flight prompts were handed out
    at (each samples with that version or a newer one: a close enough guess for a wait of milliseconds)."""
    batch = sorted(buffered)[:take]
    return (len(batch) == take and batch[-1] > only_this_batch
            and any(v == only_this_batch for v in in_flight))  # an older one is stopped: no batch may take it
