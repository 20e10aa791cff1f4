"""The calculator example's tool and reward: the model reads "what is a + b ?", may call `add`, and is paid for a
final answer equal to the sum. The tiny model cannot add; it can call the tool and copy what the tool said."""

import re


def add(a: int, b: int) -> int:
    """Adds two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the episode's last message (the model's final turn) is the sum, else 0.0."""
    out = []
    for messages, want in zip(completions, answer):
        last = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
        out.append(1.0 if re.fullmatch(r"\s*(-?\d+)\s*", last) and int(last) == int(want) else 0.0)
    return out
