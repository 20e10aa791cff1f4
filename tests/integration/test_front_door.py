"""The front door on real Ray, vLLM / transformers and DeepSpeed, offline: a TRL quick-start script whose only change
is its import, and a job file naming its model and data by their Hub ids (tests/conftest.py: hub_cache)."""

import json
import runpy

import pytest

from tandem.core.config import JobConfigError
from tests.helpers import ROOT

pytestmark = pytest.mark.integration

# TRL's documented GRPO quick start (trl/docs: grpo_trainer.md, "Quick start"), at a test's size: a Hub model and a
# Hub dataset by name, a reward function made in the script (a closure), LoRA through peft_config
TRL_SCRIPT = '''
from datasets import load_dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("tandem-test/arith", "plain", split="train")
dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["question"]}]})


def make_reward(digit):
    def reward_digit(completions, answer, **kwargs):  # answer: the dataset's column
        return [c[0]["content"].count(digit) / 8 for c in completions]
    return reward_digit


def constant(value):
    return lambda completions, **kwargs: [value] * len(completions)


training_args = GRPOConfig(output_dir=OUTPUT_DIR, bf16=False, learning_rate=1e-2, max_steps=3, logging_steps=1,
                           per_device_train_batch_size=8, num_generations=4, max_completion_length=8)
trainer = GRPOTrainer(
    model="tandem-test/tiny",
    reward_funcs=[make_reward("7"), constant(0.25)],
    args=training_args,
    train_dataset=dataset,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
)
result = trainer.train()
'''


def test_a_trl_quick_start_script_trains_on_tandem_with_only_its_import_changed(ray_session, hub_cache, tmp_path):
    out = tmp_path / "Qwen-GRPO"
    script = TRL_SCRIPT.replace("OUTPUT_DIR", repr(str(out)))
    ours = script.replace("from trl import GRPOConfig, GRPOTrainer", "from tandem import GRPOConfig, GRPOTrainer")
    assert [a for a, b in zip(script.splitlines(), ours.splitlines()) if a != b] == [
        "from trl import GRPOConfig, GRPOTrainer"]
    (tmp_path / "train.py").write_text(ours)
    ns = runpy.run_path(str(tmp_path / "train.py"), run_name="__main__")  # its functions are __main__'s
    result, trainer = ns["result"], ns["trainer"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert result.global_step == 3 and [x["step"] for x in lines] == [1, 2, 3] and result.metrics == lines[-1]
    assert all(x["rewards/1/mean"] == 0.25 for x in lines)  # the closure's captured value, on the rollout worker
    assert all(0 <= x["rewards/0/mean"] <= 1 for x in lines) and all(x["loss"] == x["loss"] for x in lines)
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tandem-test/tiny" and adapter["r"] == 8  # the Hub id, as peft
    assert (out / ".tandem" / "functions.pkl").is_file()
    # train() again: never a silent fresh start over the run; TRL's resume_from_checkpoint continues it
    with pytest.raises(JobConfigError, match="holds an earlier run"):
        trainer.train()
    with pytest.raises(JobConfigError, match="not a checkpoint of this run"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    again = trainer.train(resume_from_checkpoint=True)  # the run is complete: it resumes and trains nothing
    assert again.global_step == 3 and [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
                                       ] == [1, 2, 3]


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
