"""Rewards in child processes with a time limit: a hang or an os._exit fails only its own call, in
bounded time, and the next call is scored by a fresh process with the same numbers as in-process."""

import time

import numpy as np
import pytest

from tandem.rollout.rewards import IsolatedRewards, RewardError, RewardFunctions

pytestmark = pytest.mark.integration

SRC = '''
import os, time

def length(completions, **kw):
    return [float(len(c)) for c in completions]

def moody(completions, answer, **kw):
    if answer[0] == "hang":
        time.sleep(60)
    if answer[0] == "exit":
        os._exit(3)
    if answer[0] == "bad":
        return ["x"] * len(completions)
    return [None if i % 2 else 1.5 for i in range(len(completions))]
'''


def call(r, answer):
    return r.score(prompts=["p", "p"], completions=["ab", "abc"], completion_ids=[[1, 2], [1, 2, 3]],
                   columns={"answer": [answer, answer]}, rows=[7, 7])


def test_a_hang_or_a_dead_process_fails_only_its_call(tmp_path):
    f = tmp_path / "rew.py"
    f.write_text(SRC)
    specs = [f"{f}:length", f"{f}:moody"]
    iso = IsolatedRewards(specs, timeout_s=3.0)
    try:
        want = call(RewardFunctions(specs), "ok")
        assert np.array_equal(call(iso, "ok"), want, equal_nan=True)
        assert want.tolist()[0] == [2.0, 1.5] and np.isnan(want[1, 1])
        t = time.time()
        with pytest.raises(RewardError, match=r"row\(s\) \[7\]: no result within 3 s \(reward_timeout_s\)"):
            call(iso, "hang")
        assert time.time() - t < 10
        assert np.array_equal(call(iso, "ok"), want, equal_nan=True)  # a fresh process
        with pytest.raises(RewardError, match="the process scoring it died"):
            call(iso, "exit")
        assert np.array_equal(call(iso, "ok"), want, equal_nan=True)
        with pytest.raises(RewardError, match=r"moody' on dataset row 7: sample 0 is 'x'"):
            call(iso, "bad")  # the function's own error comes back from the child as it is
    finally:
        iso.close()
