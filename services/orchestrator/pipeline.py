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
