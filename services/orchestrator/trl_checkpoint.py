"""TRL's view of a run: `output_dir/checkpoint-N/` (the adapter or model, the tokenizer files, `trainer_state.json`)
beside Tandem's own checkpoints, and the log rows under TRL's metric names.

A TRL user's tools look there: `resume_from_checkpoint=".../checkpoint-N"`, `PeftModel.from_pretrained(base,
".../checkpoint-N")`, a model card reading `trainer_state.json`. Tandem's resumable state (optimizer, RNG, the
controller's record) stays in `checkpoints/cycle-N/`; `checkpoint-N/tandem_checkpoint` names that one."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tandem.core.adapter import ADAPTER_DIR
from tandem.core.loader import shown_name
from tandem.core.storage import Location, Store

TRL_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
POINTER = "tandem_checkpoint"  # in checkpoint-N: the name of the Tandem checkpoint it was written from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")

# Tandem's metric -> TRL GRPOTrainer's name for the same number (trl/trainer/grpo_trainer.py's _metrics keys)
TRL_NAMES = {
    "lr": "learning_rate",
    "completion_length": "completions/mean_length", "completion_length_min": "completions/min_length",
    "completion_length_max": "completions/max_length", "frac_truncated": "completions/clipped_ratio",
    "tis/weight_mean": "sampling/importance_sampling_ratio/mean",
    "tis/weight_min": "sampling/importance_sampling_ratio/min",
    "tis/weight_max": "sampling/importance_sampling_ratio/max",
    "tis/sampler_abs_diff_mean": "sampling/sampling_logp_difference/mean",
    "completion_length_terminated": "completions/mean_terminated_length",
    "completion_length_terminated_min": "completions/min_terminated_length",
    "completion_length_terminated_max": "completions/max_terminated_length",
    "cycle_s": "step_time",
}
# TRL's min / max over processes of a clip fraction: one learner's own value (Tandem's learner reduces over its ranks
# as learner/metrics.py says: the same number with one rank)
TRL_ALSO = {"clip_ratio/low_mean": "clip_ratio/low_min", "clip_ratio/high_mean": "clip_ratio/high_max"}
_REWARD_COLUMN = re.compile(r"rewards/(\d+)/(mean|std)")


@dataclass(frozen=True)
class Epochs:
    """Optimizer steps -> TRL's fractional epoch: a cycle of `steps_per_cycle` steps trains `unique_prompts` rows."""
    steps_per_cycle: int
    unique_prompts: int
    rows: int

    def at(self, step: int) -> float:
        return round(step / self.steps_per_cycle * self.unique_prompts / max(self.rows, 1), 4)


def reward_names(specs: list[str]) -> list[str]:
    """The reward columns as TRL names them: each function's own name."""
    return [shown_name(s).rsplit(":", 1)[-1].rsplit(".", 1)[-1] for s in specs]


def trl_name(key: str, rewards: list[str]) -> str:
    if m := _REWARD_COLUMN.fullmatch(key):
        i = int(m[1])
        return f"rewards/{rewards[i] if i < len(rewards) else 'environment'}/{m[2]}"
    return TRL_NAMES.get(key, key)


def log_rows(line: dict, rewards: list[str], epochs: Epochs | None) -> list[dict]:
    """One metrics.jsonl line as rows of TRL's `state.log_history`: the training row, then the evaluation's (a step
    that evaluated holds both; transformers logs them apart, the evaluation's names prefixed `eval_`). TRL's names
    where TRL has the metric, Tandem's others as they are; `epoch` and `step` last."""
    train, evaluation = {}, {}
    for k, v in line.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # a logger expects numbers: dicts (staleness_hist), None (learner/mfu off a GPU) and text stay out
        if k in TRL_ALSO:
            train[TRL_ALSO[k]] = v
        if k.startswith("eval/"):
            evaluation[f"eval_{trl_name(k[5:], rewards)}"] = v
        elif k == "eval_s":
            evaluation["eval_runtime"] = v
        elif k not in ("step", "time"):
            train[trl_name(k, rewards)] = v
    step = int(line.get("step", 0))
    tail = ({"epoch": epochs.at(step)} if epochs is not None else {}) | {"step": step}
    return [row | tail for row in (train, evaluation) if row]


def log_history(lines: list[dict], rewards: list[str], epochs: Epochs | None) -> list[dict]:
    """Every line's rows, each training row with TRL's `num_tokens`: the tokens trained so far (the loss's tokens of
    every step up to it; TRL counts prompt tokens too, which Tandem's metrics do not hold)."""
    out, seen = [], 0.0
    for x in lines:
        if "step" not in x:
            continue
        seen += float(x.get("tokens") or 0.0)
        rows = log_rows(x, rewards, epochs)
        if rows and "loss" in rows[0]:
            rows[0] = {"num_tokens": seen} | rows[0]
        out += rows
    return out


def trainer_state(lines: list[dict], cfg, global_step: int, max_steps: int, epochs: Epochs | None) -> dict:
    """The run at `global_step` as transformers' TrainerState's fields (what its save_to_json writes, which
    TrainerState.load_from_json reads back): written here as a dict, so that the controller, which never imports
    torch, need not import transformers' trainer for it."""
    return {
        "best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
        "epoch": epochs.at(global_step) if epochs else None, "eval_steps": cfg.eval.eval_steps or 500,
        "global_step": global_step, "is_hyper_param_search": False, "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": log_history([x for x in lines if x.get("step", 0) <= global_step], reward_names(cfg.rewards),
                                   epochs),
        "logging_steps": 1, "max_steps": max_steps, "num_input_tokens_seen": 0,
        "num_train_epochs": max(int(cfg.batch.num_train_epochs), 1), "save_steps": cfg.checkpoint.save_steps,
        "stateful_callbacks": {}, "total_flos": 0, "train_batch_size": cfg.batch.per_device_train_batch_size,
        "trial_name": None, "trial_params": None,
    }


def write_trl_checkpoint(ckpt: str, cfg, lines: list[dict], max_steps: int, epochs: Epochs | None) -> Location:
    """`<output_dir>/checkpoint-<step>/` from the Tandem checkpoint `ckpt` (complete: its tandem.json written), whole
    or not at all: `trainer_state.json` is written last and names it complete. Older ones beyond
    checkpoint.save_total_limit are removed. -> where it is."""
    src = Store(ckpt)
    step = int(json.loads(src.read_text("tandem.json"))["steps"])
    out = Store(cfg.logging.output_dir)
    name = f"checkpoint-{step}"
    write_model_files(ckpt, cfg, out, name)  # replaces the directory (a rolled-back run saving the same step again)
    out.write_bytes(f"{name}/{POINTER}", Location(ckpt).name.encode())
    state = trainer_state(lines, cfg, step, max_steps, epochs)
    # TrainerState.save_to_json's text, through the store (a URI has no local path to give it)
    out.write_bytes(f"{name}/trainer_state.json", (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
    prune(cfg.logging.output_dir, cfg.checkpoint.save_total_limit)
    return Location(cfg.logging.output_dir) / name


def write_model_files(ckpt: str, cfg, out: Store, name: str) -> None:
    """The trained weights of `ckpt` (its adapter, PEFT format; or its model) and the model's tokenizer files into
    `out/name`, as TRL's save_model writes them."""
    src = Store(ckpt)
    src.copy_to(ADAPTER_DIR if src.exists(ADAPTER_DIR) else "model", out, name)
    write_tokenizer_files(cfg, out, name)


def write_tokenizer_files(cfg, out: Store, rel: str = "") -> None:
    """The tokenizer files saved with the job's model (every node's tokenizer) into `out/rel`."""
    tokenizer = Store(cfg.model.local_dir())
    for f in TOKENIZER_FILES:
        if tokenizer.is_file(f):
            out.write_bytes(f"{rel}/{f}" if rel else f, tokenizer.read_bytes(f))


def trl_checkpoints(output_dir: str) -> list[tuple[int, Location]]:
    """Complete `checkpoint-N` directories (trainer_state.json inside), oldest first."""
    store = Store(output_dir)
    if not store.exists():
        return []
    found = [(int(m[1]), Location(output_dir) / name) for name, is_dir in store.children()
             if is_dir and (m := TRL_CHECKPOINT.fullmatch(name)) and store.is_file(f"{name}/trainer_state.json")]
    return sorted(found)


def prune(output_dir: str, keep: int | None) -> None:
    if keep is None:
        return
    for _, old in trl_checkpoints(output_dir)[:-keep]:
        Store(old).delete()


def tandem_checkpoint(trl_ckpt: str, checkpoint_dir: str) -> Location | None:
    """The Tandem checkpoint a `checkpoint-N` was written from, or None where it names none."""
    store = Store(trl_ckpt)
    if not store.is_file(POINTER):
        return None
    return Location(checkpoint_dir) / store.read_text(POINTER).strip()
