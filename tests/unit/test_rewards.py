"""Reward functions: TRL convention, None -> NaN, errors name the function and the row."""

import math

import numpy as np
import pytest

from tandem.rollout.rewards import RewardError, RewardFunctions


@pytest.fixture
def module(tmp_path):
    p = tmp_path / "rf.py"
    p.write_text(
        "import asyncio\n"
        "def ok(prompts, completions, completion_ids, answer, **kw):\n"
        "    return [float(len(c)) + a for c, a in zip(completions, answer)]\n"
        "def partial(completions, **kw):\n    return [None, 1.0, None]\n"
        "async def slow(completions, **kw):\n    await asyncio.sleep(0)\n    return [2.0] * len(completions)\n"
        "def boom(completions, **kw):\n    raise KeyError('missing')\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def text(completions, **kw):\n    return ['high'] * len(completions)\n"
        "def inf(completions, **kw):\n    return [float('inf')] * len(completions)\n"
        "def chat(completions, **kw):\n    return [float(c[0]['role'] == 'assistant') for c in completions]\n"
    )
    return str(p)


def call(spec, rows=(7, 7, 7), completions=("a", "bb", "ccc")):
    rf = RewardFunctions(spec)
    return rf.score(prompts=["p"] * 3, completions=list(completions), completion_ids=[[1], [2, 2], [3, 3, 3]],
                    columns={"answer": [10, 10, 10]}, rows=list(rows))


def test_values_none_and_async(module):
    r = call([f"{module}:ok", f"{module}:partial", f"{module}:slow"])
    assert r.shape == (3, 3) and r.dtype == np.float32
    assert r[:, 0].tolist() == [11.0, 12.0, 13.0]
    assert math.isnan(r[0, 1]) and r[1, 1] == 1.0 and math.isnan(r[2, 1])
    assert r[:, 2].tolist() == [2.0, 2.0, 2.0]


def test_chat_completions(module):
    r = call([f"{module}:chat"], completions=[[{"role": "assistant", "content": "x"}]] * 3)
    assert r[:, 0].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("fn,text", [
    ("boom", "raised KeyError"), ("short", "list of 3 floats"), ("text", "'high'"), ("inf", "must be finite")])
def test_errors_name_function_and_row(module, fn, text):
    with pytest.raises(RewardError) as e:
        call([f"{module}:{fn}"])
    msg = str(e.value)
    assert f"rf.py:{fn}" in msg and "row" in msg and "7" in msg and text in msg
