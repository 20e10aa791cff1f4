"""The end-to-end benchmarks' reward (TRL's signature, token ids only: the same cost for every candidate):
the fraction of completion tokens whose id is a multiple of 7."""


def ids_reward(completions, completion_ids, **kw):
    return [sum(t % 7 == 0 for t in ids) / len(ids) if ids else 0.0 for ids in completion_ids]
