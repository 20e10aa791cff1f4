"""Reward functions for the example tasks (TRL's signature)."""

import re


def length_reward(completions, **kw):
    """1 at 8 characters, falling linearly to 0 at 0 or 16: dense, easy to see rise."""
    return [max(0.0, 1.0 - abs(len(c if isinstance(c, str) else c[0]["content"]) - 8) / 8) for c in completions]


def digits_reward(completions, **kw):
    """Fraction of characters that are digits."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[0]["content"]
        out.append(sum(ch.isdigit() for ch in text) / len(text) if text else 0.0)
    return out


def addition_reward(completions, answer, **kw):
    """1 if the completion starts with the right sum, 0 otherwise."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        m = re.match(r"\s*(-?\d+)", text)
        out.append(1.0 if m and int(m.group(1)) == int(a) else 0.0)
    return out


def only_some(completions, **kw):
    """None for odd samples: a function that does not apply everywhere."""
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def sevens_reward(completions, **kw):
    """The demo's reward: the fraction of characters that are the digit 7 (0 for an empty answer)."""
    out = []
    for c in completions:
        text = (c if isinstance(c, str) else c[0]["content"]).strip()
        out.append(text.count("7") / len(text) if text else 0.0)
    return out
