"""The front door on real Ray, vLLM / transformers and DeepSpeed, offline: a TRL quick-start script whose only change
is its import, and a job file naming its model and data by their Hub ids (tests/conftest.py: hub_cache)."""

import json
import runpy
from pathlib import Path

import pytest

from tandem.core.config import JobConfigError
from tests.helpers import ROOT

pytestmark = pytest.mark.integration

# TRL's documented GRPO quick start (trl/docs: grpo_trainer.md, "Quick start"), at a test's size: a Hub model and a
# Hub dataset by name, a reward function made in the script (a closure), LoRA through peft_config; then what a TRL
# script does after train(): a callback, save_model, evaluate, the state, push_to_hub. It writes what it saw to
# OUTPUT_DIR.json, the same under TRL and under Tandem.
TRL_SCRIPT = '''
import json

from datasets import load_dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("tandem-test/arith", "plain")
dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["question"]}]})


def make_reward(digit):
    def reward_digit(completions, answer, **kwargs):  # answer: the dataset's column
        return [c[0]["content"].count(digit) / 8 for c in completions]
    return reward_digit


def constant(value):
    def constant_reward(completions, **kwargs):
        return [value] * len(completions)
    return constant_reward


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(["step_end", state.global_step])

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(["log", state.global_step, "loss" in logs])

    def on_save(self, args, state, control, **kwargs):
        self.events.append(["save", state.global_step])

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(["train_end", state.global_step])


training_args = GRPOConfig(output_dir=OUTPUT_DIR, bf16=False, use_cpu=True, learning_rate=1e-2, max_steps=3,
                           logging_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                           save_steps=2, save_total_limit=1, seed=3)
trainer = GRPOTrainer(
    model="tandem-test/tiny",
    reward_funcs=[make_reward("7"), constant(0.25)],
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
)
recorder = Recorder()
trainer.add_callback(recorder)
result = trainer.train()
trainer.save_model(OUTPUT_DIR + "-saved")
metrics = trainer.evaluate()
try:
    trainer.push_to_hub()
    pushed = "pushed"
except Exception as e:
    pushed = f"{type(e).__name__}: {e}"
trained = trainer.model
with open(OUTPUT_DIR + ".json", "w") as f:
    json.dump({"global_step": result.global_step, "training_loss": result.training_loss, "metrics": result.metrics,
               "state_step": trainer.state.global_step, "best_metric": trainer.state.best_metric,
               "log_history": trainer.state.log_history, "events": recorder.events, "evaluate": metrics,
               "pushed": pushed, "model": type(trained).__name__}, f, default=str)
'''


def check_trl_script(out, seen: dict) -> None:
    """What the script saw and wrote, as TRL's GRPOTrainer gives it (run under both)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert seen["global_step"] == seen["state_step"] == 3 and seen["best_metric"] is None
    assert seen["training_loss"] == seen["training_loss"] and {"train_runtime", "train_loss"} <= set(seen["metrics"])
    train_rows = [r for r in seen["log_history"] if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3], seen["log_history"]
    for key in ("reward", "reward_std", "learning_rate", "grad_norm", "rewards/reward_digit/mean",
                "rewards/constant_reward/mean", "completions/mean_length", "epoch"):
        assert all(key in r for r in train_rows), (key, train_rows[0])
    assert all(r["rewards/constant_reward/mean"] == 0.25 for r in train_rows)  # the closure's value, where it ran
    assert [e for e in seen["events"] if e[0] == "step_end"] == [["step_end", s] for s in (1, 2, 3)]
    assert [e[1] for e in seen["events"] if e[0] == "log" and e[2]] == [1, 2, 3]
    events = [e[:2] for e in seen["events"]]
    assert ["save", 2] in events and events.index(["train_end", 3]) > events.index(["step_end", 3])
    assert "eval_reward" in seen["evaluate"]
    assert "offline" in seen["pushed"].lower(), seen["pushed"]
    assert seen["model"].startswith("Peft")
    # TRL's layout: checkpoint-N with the adapter, the tokenizer and trainer_state.json; save_total_limit 1
    ckpts = sorted(p.name for p in out.glob("checkpoint-*"))
    assert ckpts == ["checkpoint-3"], ckpts
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [r["step"] for r in state["log_history"] if "loss" in r] == [1, 2, 3]
    base = AutoModelForCausalLM.from_pretrained("tandem-test/tiny")
    for d in (out / "checkpoint-3", out.parent / f"{out.name}-saved"):
        assert (d / "tokenizer_config.json").is_file() and (d / "adapter_config.json").is_file(), sorted(d.iterdir())
        PeftModel.from_pretrained(base, str(d))  # peft reads it as its own
        AutoTokenizer.from_pretrained(str(d))


def test_a_trl_script_runs_to_its_last_line_on_tandem_as_on_trl(ray_session, hub_cache, tmp_path):
    """The script above, run by TRL's own GRPOTrainer on this CPU and by Tandem with only its import changed: the same
    checks hold on what each saw and wrote (check_trl_script). Then Tandem's own promises on the run."""
    import os
    import subprocess
    import sys

    from tandem.core.errors import TandemError

    ours = TRL_SCRIPT.replace("from trl import GRPOConfig, GRPOTrainer", "from tandem import GRPOConfig, GRPOTrainer")
    assert [a for a, b in zip(TRL_SCRIPT.splitlines(), ours.splitlines()) if a != b] == [
        "from trl import GRPOConfig, GRPOTrainer"]
    outs = {}
    for name, text in (("trl", TRL_SCRIPT), ("tandem", ours)):
        (tmp_path / name).mkdir()
        outs[name] = tmp_path / name / "Qwen-GRPO"
        (tmp_path / name / "train.py").write_text(text.replace("OUTPUT_DIR", repr(str(outs[name]))))
    # a fresh process as a user's: not the torch.distributed variables this one's in-process learners set
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                          "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    trl_run = subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path / "trl", stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=dict(env, CUDA_VISIBLE_DEVICES=""))
    ns = runpy.run_path(str(tmp_path / "tandem" / "train.py"), run_name="__main__")  # its functions are __main__'s
    out, trainer = outs["tandem"], ns["trainer"]
    check_trl_script(out, json.loads(Path(f"{out}.json").read_text()))
    _, err = trl_run.communicate(timeout=300)  # TRL ran beside it
    assert trl_run.returncode == 0, err[-3000:]
    check_trl_script(outs["trl"], json.loads(Path(f"{outs['trl']}.json").read_text()))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tandem-test/tiny" and adapter["r"] == 8  # the Hub id, as peft
    assert (out / "adapter" / "tokenizer.json").is_file()  # the final adapter with its tokenizer
    # train() again: never a silent fresh start over the run, said in the Python caller's words
    with pytest.raises(JobConfigError, match=r"holds an earlier run .*train\(resume_from_checkpoint=True\) to continue "
                                             r"it, GRPOConfig\(overwrite_output_dir=True\) to start over"):
        trainer.train()
    with pytest.raises(JobConfigError, match="not a checkpoint of this run"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    assert isinstance(JobConfigError("x"), TandemError)
    again = trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))  # complete: resumes, trains nothing
    assert again.global_step == 3 and [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
                                       ] == [1, 2, 3]


def short_reward(completions, **kwargs):
    return [0.0]  # one value for the group's 4 completions


def test_a_reward_of_the_wrong_shape_is_its_python_error_at_the_first_prompt(ray_session, hub_cache, tmp_path):
    """Not a Ray wrapper after a run of failed prompts: RewardContractError (a TandemError), its message the line the
    CLI prints, naming the function as it was given (not the pickle it travelled in), the actor's traceback as the
    cause's text; no prompt recorded as failed before it."""
    from peft import LoraConfig

    from tandem import GRPOConfig, GRPOTrainer
    from tandem.core.errors import RewardContractError
    from tandem.services.app.python_errors import ActorTraceback

    args = GRPOConfig(output_dir=str(tmp_path / "bad"), bf16=False, max_steps=1, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=4)
    trainer = GRPOTrainer(model=hub_cache["model"], reward_funcs=short_reward, args=args,
                          train_dataset=[{"prompt": f"{a} + {a}"} for a in range(8)],
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with pytest.raises(RewardContractError, match=r"^reward function 'short_reward' on dataset row\(s\) \[\d\]: must "
                                                  r"return a list of 4 floats or None, got list of length 1$") as e:
        trainer.train()
    assert isinstance(e.value.__cause__, ActorTraceback) and "\x1b[" not in str(e.value.__cause__)
    cause = str(e.value.__cause__)  # the controller's frames down to where it stopped the job
    assert cause.startswith("ray::Controller.step()") and "in accept" in cause and "short_reward" in cause, cause
    assert not (tmp_path / "bad" / "failed_prompts.jsonl").is_file()


def test_a_job_file_names_its_model_revision_and_data_by_hub_id(ray_session, hub_cache, tmp_path):
    """model.revision v2 (another seed than main), the dataset by name, configuration and split, shaped by
    data.map and data.system_prompt, its test split as eval: trained by the same controller `tandem run` starts."""
    from tandem.core.config import JobConfig
    from tandem.services.app.run import run_job

    (tmp_path / "shape.py").write_text("def to_prompt(row):\n    return {'prompt': 'What is ' + row['question'] + '?'}\n")
    cfg = JobConfig.from_dict({
        "model": {"path": hub_cache["model"], "revision": "v2", "dtype": "float32", "lora": {"r": 8, "lora_alpha": 16}},
        "data": {"path": hub_cache["dataset"], "name": "plain", "split": "train", "map": f"{tmp_path}/shape.py:to_prompt",
                 "system_prompt": "Answer with digits only."},
        "eval": {"path": hub_cache["dataset"], "name": "plain", "split": "test", "num_generations": 2},
        "rewards": [f"{ROOT}/examples/rewards.py:digits_reward"],
        "generation": {"max_prompt_length": 64, "max_completion_length": 8},
        "batch": {"per_device_train_batch_size": 8, "num_generations": 4, "max_steps": 2},
        "optimizer": {"learning_rate": 1e-2}, "cluster": {"max_restarts": 0},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False}})
    assert run_job(cfg) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and "eval/reward" in lines[-1]
    adapter = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == ("tandem-test/tiny", "v2")
    saved = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/tandem.json")).read_text())
    fp = saved["controller"]["fingerprint"]
    assert fp["data.path"] == "tandem-test/arith" and fp["data rows"] == 16 and len(fp["data content"]) == 16
    # the files the run read are the revision's, not main's of the same name: their content digests
    from huggingface_hub import constants

    from tandem.services.orchestrator.checkpointer import _files_digest

    snapshots = Path(constants.HF_HUB_CACHE) / "models--tandem-test--tiny" / "snapshots"
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    v2, main = (_files_digest(snapshots / hub_cache[r], names) for r in ("v2", "main"))
    assert v2 != main and fp["model files"] == v2
