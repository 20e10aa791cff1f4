"""How far the rollout side may run ahead of the learner: pure arithmetic of `cluster.max_staleness` (k).

Versions: the learner at version t trains one batch of U = unique_prompts groups and makes t + 1, which the workers
then serve. A group sampled with version s may be trained by a learner at version t only if t - s <= k
(services/orchestrator/group_buffer.py drops the others and samples their prompts again).

A prompt handed out now is sampled with the version served now, v, or a newer one. Batches are taken oldest group
first, so the prompts outstanding (buffered or in flight) fill the next batches in order. While no batch is in
training, the learner is at v: the next take trains at v, the one after at v + 1, ..., so k + 1 batches may be
outstanding (the k-th trains at v + k: a lag of k). While a batch is in training (taken, making v + 1), the batches
after it train at v + 1 ... v + k: k of them. Handing out fewer leaves the engine idle before the bound; more, and
the groups past the bound are sampled only to be dropped. Never past the run's last batch.
"""

from __future__ import annotations


def prompts_wanted(unique_prompts: int, max_staleness: int, training: bool, batches_left: int) -> int:
    """Prompts to keep outstanding (buffered + in flight) now. training: a batch is taken and not yet trained;
    batches_left: the run's batches not yet trained, that one included."""
    untaken = batches_left - int(training)
    return unique_prompts * max(0, min(max_staleness + 1 - int(training), untaken))


def trained_ahead_allowed(max_staleness: int, batches_left: int, checkpoint_due: bool, stopping: bool) -> bool:
    """Whether the next batch may start training before this cycle's bookkeeping (publish wait, metrics, record, the
    driver's next call): with max_staleness >= 1 its groups need not wait for the version being published, and the
    learner then never idles between batches. Not when this cycle saves a checkpoint (the save must hold this cycle's
    weights, and the learner runs its calls in order), past the last batch, or when the job is stopping."""
    return max_staleness >= 1 and batches_left > 0 and not checkpoint_due and not stopping
