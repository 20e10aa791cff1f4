"""What made a micro-batch's loss non-finite, in words: the first of its inputs that is not finite on a token the loss
reads, at which sequence and token, and the prompt it came from, so that a report of one needs no rerun."""

from __future__ import annotations

import torch

from tandem.learner.grpo import LossInputs


def non_finite_input(x: LossInputs, tis_weight: torch.Tensor | None = None) -> tuple[str, int, int] | None:
    """(input name, row, token) of the first non-finite value among the loss's inputs on a masked-in token, in the
    order they are computed (the sampler's log-probs, the old, the reference, the policy's, the advantages, the TIS
    weights); None when every input is finite there."""
    m = x.mask.bool()
    per_token = [("the sampler's log-probs", x.sampler_logp), ("old log-probs", x.old_logp),
                 ("reference log-probs", x.ref_logp), ("log-probs", x.logp), ("TIS weights", tis_weight)]
    for name, t in per_token[:4]:
        if (at := _first_bad(t, m)) is not None:
            return name, *at
    bad_adv = ~torch.isfinite(x.advantages.float()) & m.any(-1)
    if bad_adv.any():
        return "advantages", int(bad_adv.nonzero()[0, 0]), -1
    name, t = per_token[4]
    if (at := _first_bad(t, m)) is not None:
        return name, *at
    return None


def _first_bad(t: torch.Tensor | None, m: torch.Tensor) -> tuple[int, int] | None:
    if t is None:
        return None
    bad = ~torch.isfinite(t.detach().float()) & m
    if not bad.any():
        return None
    row, tok = bad.nonzero()[0].tolist()
    return int(row), int(tok)


def describe(found: tuple[str, int, int] | None, samples: list[int], origins: list[tuple[int, int]],
             num_generations: int) -> str:
    """The words for non_finite_input's answer; per row of the micro-batch: its sample index in the generation batch
    (`samples`) and its group's (group id, dataset index) (`origins`)."""
    if found is None:
        return ("every input (log-probs, old and sampler log-probs, advantages, TIS weights) is finite on the "
                "masked tokens: the loss's own arithmetic overflowed")
    name, row, tok = found
    i, (group, index) = samples[row], origins[row]
    where = "" if tok < 0 else f", token {tok}"
    return (f"{name} not finite at sequence {i} (completion {i % num_generations} of group {group}, the prompt at "
            f"dataset index {index}){where}")
