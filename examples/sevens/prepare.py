"""Builds the demo's model: a tiny Qwen2-shaped model and tokenizer made here, then warmed up
with a short supervised stage on a toy language (random digit strings), so that GRPO with LoRA
has something to steer. Also writes the prompt dataset.

    python examples/sevens/prepare.py runs/sevens
"""

import json
import random
import sys
import time
from pathlib import Path

import torch

from tandem.services.devtools.tiny_model import build_tiny_model
from tandem.services.devtools.warm_up import sft_step

PROMPTS = ["write a number", "say some digits", "give me digits", "a number please", "digits", "count"]


SAY_EVERY_S = 10.0  # how often the warm-up says how far it is


def sample_text(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 12)))


def warm_up(model_dir: Path, steps: int = 300, batch: int = 32, seed: int = 0) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    templated = {}  # the chat template once per prompt: 9,600 renderings were a third of the warm-up
    t0 = said = time.time()
    for step in range(steps):
        seqs, masks = [], []
        for _ in range(batch):
            q = rng.choice(PROMPTS)
            if q not in templated:
                t = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
                templated[q] = list(t["input_ids"] if isinstance(t, dict) or hasattr(t, "input_ids") else t)
            p = templated[q]
            c = tok(sample_text(rng), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(p + c)
            masks.append([0] * len(p) + [1] * len(c))
        loss = sft_step(model, opt, seqs, masks, tok.pad_token_id)
        if time.time() - said >= SAY_EVERY_S:  # no silent minute on a slow machine
            said = time.time()
            print(f"warm-up: step {step + 1} of {steps}, SFT loss {float(loss):.3f} ({said - t0:.0f} s)", flush=True)
    model.save_pretrained(model_dir)
    return float(loss)


def main(out: str) -> None:
    t0 = time.time()
    root = Path(out)
    model_dir = root / "model"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "eval.jsonl", "w") as f:  # the eval set: each prompt once (eval samples 8 per prompt)
        f.write("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    if (model_dir / "warm.json").is_file():
        print(f"model ready: {model_dir}")
        return
    print(f"building a tiny Qwen2-shaped model in {model_dir}, then warming it up on digit strings (under a "
          "minute on 2 cores)", flush=True)
    build_tiny_model(model_dir, layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, seed=0)
    loss = warm_up(model_dir)
    (model_dir / "warm.json").write_text(json.dumps({"sft_loss": loss}))
    rng = random.Random(1)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(256):
            f.write(json.dumps({"prompt": [{"role": "user", "content": rng.choice(PROMPTS)}], "id": i}) + "\n")
    print(f"warm-up done in {time.time() - t0:.0f} s (SFT loss {loss:.3f}); model: {model_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/sevens")
