"""The agentic benchmark's task, shared by every candidate: "what is a + b + c (+ d) ?", a tool `add` that answers
as a remote service does (an async call taking a seeded 0.2-1 s), and the reward (the final answer is the sum)."""

import asyncio
import random
import re

SLEEP = (0.2, 1.0)  # seconds per call, seeded by the arguments


def call_seconds(a: int, b: int) -> float:
    return random.Random(a * 100_003 + b).uniform(*SLEEP)


async def add(a: int, b: int) -> int:
    """Adds two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    await asyncio.sleep(call_seconds(int(a), int(b)))
    return int(a) + int(b)


def correct_sum(completions, answer, **kwargs) -> list[float]:
    """1.0 when the episode's last message is the model's answer and it is the sum, else 0.0."""
    out = []
    for messages, want in zip(completions, answer):
        last = messages[-1] if isinstance(messages, list) else {"role": "assistant", "content": messages}
        text = last.get("content") or "" if last.get("role") == "assistant" else ""
        out.append(1.0 if re.fullmatch(r"\s*-?\d+\s*", text) and int(text) == int(want) else 0.0)
    return out
