"""Tiny Qwen2-shaped models with a locally trained tokenizer: tests, the demo and benchmarks
never touch a model hub."""

from __future__ import annotations

import json
import string
from pathlib import Path

EOS, PAD, IM_START = "<|im_end|>", "<|endoftext|>", "<|im_start|>"

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's shape, short: the tools' names in a system turn, calls as <tool_call>{json}</tool_call> (single tokens, as
# in Qwen's vocabulary), results in a tool turn; prefix-preserving, so episodes' ids are exact (rollout/episodes.py)
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(vocab: int = 512, tool_tokens: bool = False) -> list[str]:
    words = ("the a an of to and in is it you that he was for on are with as I his they be at one have this "
             "from or had by hot word but what some we can out other were all there when up use your how said "
             "answer question sum add sort list count length yes no true false user assistant system").split()
    lines = [" ".join(words[i:i + 8]) for i in range(0, len(words), 3)]
    lines += [f"{a} + {b} = {a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    lines += [" ".join(string.ascii_lowercase[i:i + 5]) for i in range(22)]
    lines += [string.ascii_letters + string.digits + string.punctuation]
    if vocab > 4096:  # a real model's vocabulary size: enough distinct random words for that many merges
        import random

        rng = random.Random(0)
        letters = string.ascii_lowercase
        words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(vocab * 3)]
        lines += [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    if tool_tokens:  # a tool call's JSON in few tokens, as a real vocabulary writes it
        lines += [json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) for a in range(0, 100, 9) for b in (3, 50)]
    return lines * 4


def build_tokenizer(vocab: int = 512, tool_tokens: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, IM_START, EOS]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(vocab, tool_tokens), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START])
    fast.chat_template = CHATML
    if tool_tokens:  # after the BPE ids: the ids of everything else stay as without them
        from tokenizers import AddedToken

        fast.add_tokens([AddedToken(TOOL_CALL, special=False), AddedToken(TOOL_CALL_END, special=False)])
        fast.chat_template = CHATML_TOOLS
    return fast


def build_tiny_model(out_dir: str | Path, *, layers: int = 2, hidden: int = 64, vocab: int = 512, heads: int = 2,
                     kv_heads: int = 1, seed: int = 0, tie_word_embeddings: bool = False,
                     max_position_embeddings: int = 1024, dtype: str = "float32",
                     intermediate: int | None = None, tool_tokens: bool = False, device: str = "cpu") -> Path:
    """Random-init Qwen2ForCausalLM + byte-level BPE tokenizer (ChatML) in `out_dir`, in seconds; tool_tokens: the
    tool-call tokens and the template of a tool-calling model (CHATML_TOOLS); device: where the weights are drawn
    ("cuda": a 7B in seconds, not minutes; other numbers than the CPU's for the same seed)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab, tool_tokens)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None, rope_theta=10000.0, torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    meta = json.loads((out / "config.json").read_text())
    meta.setdefault("tandem_tiny_model", {"seed": seed})
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    return out
