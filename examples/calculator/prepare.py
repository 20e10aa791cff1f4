"""Builds the calculator example's model: a tiny Qwen2-shaped model whose tokenizer knows <tool_call> (as Qwen's
does), warmed up by a short supervised stage on episodes of three kinds: call `add` and copy its result, answer at
once with a guess, call `add` and then answer something else. GRPO then has a choice to sharpen: the episodes that
call the tool and copy its result are the ones paid. Also writes the prompts.

    python examples/calculator/prepare.py runs/calculator
"""

import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's examples package
from examples.calculator.task import add  # noqa: E402
from tandem.rollout.episodes import ToolTurnTemplate  # noqa: E402
from tandem.rollout.tools import tool_schemas  # noqa: E402
from tandem.services.devtools.tiny_model import TOOL_CALL, TOOL_CALL_END, build_tiny_model  # noqa: E402
from tandem.services.devtools.warm_up import sft_step  # noqa: E402

KINDS = (("tool_and_copy", 0.4), ("guess", 0.4), ("tool_then_guess", 0.2))


def question(rng: random.Random) -> tuple[list[dict], int, int]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return [{"role": "user", "content": f"what is {a} + {b} ?"}], a, b


def episode(tok, template, rng: random.Random, kinds=KINDS) -> tuple[list[int], list[int]]:
    """One warm-up episode as the rollout worker builds them: the prompt, the model's turns (trained on) and the
    tool's turn between them (not trained on). -> (ids, loss mask)"""
    messages, a, b = question(rng)
    prompt = list(tok.apply_chat_template(messages, tools=tool_schemas([add]), add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"])
    kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
    eos = [tok.eos_token_id]

    def said(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + eos
    guess = str(rng.randint(0, 198))
    if kind == "guess":
        turns = [(said(guess), 1)]
    else:
        call = said(TOOL_CALL + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + TOOL_CALL_END)
        result = template.suffix_ids([{"role": "tool", "name": "add", "content": str(a + b)}])
        turns = [(call, 1), (result, 0), (said(str(a + b) if kind == "tool_and_copy" else guess), 1)]
    ids, mask = list(prompt), [0] * len(prompt)
    for t, m in turns:
        ids += t
        mask += [m] * len(t)
    return ids, mask


def warm_up(model_dir: Path, steps: int, batch: int = 32, seed: int = 0, kinds=KINDS) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    template = ToolTurnTemplate(tok, str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    for _ in range(steps):
        seqs, masks = zip(*(episode(tok, template, rng, kinds) for _ in range(batch)))
        loss = sft_step(model, opt, seqs, masks, tok.pad_token_id)
    model.save_pretrained(model_dir)
    return float(loss)


def build(model_dir: Path, steps: int = 1200, kinds=KINDS) -> float:
    """The warmed-up model in model_dir (tests build one in fewer steps, on the episodes that call the tool only).
    -> the last SFT loss"""
    build_tiny_model(model_dir, layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, seed=0, tool_tokens=True)
    return warm_up(model_dir, steps, kinds=kinds)


def main(out: str) -> None:
    t0 = time.time()
    root = Path(out)
    model_dir = root / "model"
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(512):
            messages, a, b = question(rng)
            f.write(json.dumps({"prompt": messages, "answer": a + b}) + "\n")
    if (model_dir / "warm.json").is_file():
        print(f"model ready: {model_dir}")
        return
    loss = build(model_dir)
    (model_dir / "warm.json").write_text(json.dumps({"sft_loss": loss}))
    print(f"warm-up done in {time.time() - t0:.0f} s (SFT loss {loss:.3f}); model: {model_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/calculator")
