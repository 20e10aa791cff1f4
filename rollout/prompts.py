"""Prompt rows -> token ids, once, with the model's own chat template."""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptError(ValueError):
    pass


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def tokenize_prompt(tokenizer, prompt: Any, *, max_prompt_length: int, truncate: bool, row: int,
                    tools: list[dict] | None = None) -> np.ndarray:
    """Chat prompts (lists of messages) get the chat template with the generation prompt (and the tools' schemas in
    its tool section, as TRL renders them); text prompts are tokenized as they are. Too long: an error naming the
    row, or left-truncation."""
    if tools and not is_chat(prompt):
        raise PromptError(f"dataset row {row}: a job with tools needs chat prompts (a list of messages), got "
                          f"{type(prompt).__name__}: the tools' schemas and results go through the chat template")
    if is_chat(prompt):
        ids = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        raise PromptError(f"dataset row {row}: prompt must be a string or a list of chat messages, "
                          f"got {type(prompt).__name__}")
    if len(ids) == 0:
        raise PromptError(f"dataset row {row}: prompt is empty after tokenization")
    if len(ids) > max_prompt_length:
        if not truncate:
            raise PromptError(f"dataset row {row}: prompt has {len(ids)} tokens > generation.max_prompt_length = "
                              f"{max_prompt_length} (set data.truncate_long_prompts: true to left-truncate)")
        ids = ids[-max_prompt_length:]
    return np.asarray(ids, dtype=np.int32)


def completion_views(tokenizer, prompt: Any, tokens: list[np.ndarray], eos_id: int | None):
    """Completions as reward functions see them: text, or assistant messages for chat prompts."""
    texts = [tokenizer.decode([int(t) for t in c if int(t) != eos_id], skip_special_tokens=True) for c in tokens]
    if is_chat(prompt):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return texts
