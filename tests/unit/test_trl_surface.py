"""What a TRL script reads of a Tandem run: log rows under TRL's metric names, the epoch, the fields table docs/trl.md
shows, and a failed run as the Python error of its cause."""

import pytest

from tandem.services.orchestrator.trl_checkpoint import Epochs, log_history, log_rows, reward_names
from tests.helpers import ROOT


def test_a_metrics_line_becomes_trls_rows_train_then_evaluation():
    line = {"time": 1.0, "step": 4, "loss": 0.5, "lr": 1e-3, "reward": 0.7, "rewards/0/mean": 0.2, "rewards/1/std": 0.1,
            "completion_length": 7.5, "frac_truncated": 0.25, "tis/weight_mean": 1.01, "learner/mfu": 0.4,
            "eval/reward": 0.9, "eval/rewards/0/mean": 0.3, "eval/completion_length": 6.0, "eval_s": 2.5}
    names = reward_names(["/run/.tandem/functions.pkl:digits", "examples/rewards.py:length_reward"])
    assert names == ["digits", "length_reward"]
    train, evaluation = log_rows(line, names, Epochs(steps_per_cycle=2, unique_prompts=4, rows=16))
    assert train == {"loss": 0.5, "learning_rate": 1e-3, "reward": 0.7, "rewards/digits/mean": 0.2,
                     "rewards/length_reward/std": 0.1, "completions/mean_length": 7.5,
                     "completions/clipped_ratio": 0.25, "sampling/importance_sampling_ratio/mean": 1.01,
                     "learner/mfu": 0.4, "epoch": 0.5, "step": 4}  # 4 steps = 2 cycles of 4 rows of 16
    assert evaluation == {"eval_reward": 0.9, "eval_rewards/digits/mean": 0.3, "eval_completions/mean_length": 6.0,
                          "eval_runtime": 2.5, "epoch": 0.5, "step": 4}
    assert log_rows({"step": 0, "eval/reward": 0.1}, names, None) == [{"eval_reward": 0.1, "step": 0}]
    assert [r["step"] for r in log_history([{"step": 1, "loss": 1.0}, {"note": "x"}, line], names, None)] == [1, 4, 4]


def test_docs_trl_table_is_the_one_the_installed_trl_gives_and_classes_every_field():
    from tandem.services.devtools.reference import trl_defaults, trl_markdown

    table = trl_markdown()
    assert table in (ROOT / "docs" / "trl.md").read_text(), "regenerate: python -m tandem.services.devtools.reference trl"
    rows = [r for r in table.splitlines() if r.startswith("| `")]
    assert len(rows) == len(trl_defaults()) > 150
    assert not [r for r in rows if "| unknown |" in r]
    assert "| `vllm_mode` | `'colocate'` | applied |" in table
    assert "| `hub_model_id` | `None` | ignored | the Hub: trainer.push_to_hub() reads" in table


def test_vllm_mode_is_trls_where_vllm_samples(tmp_path):
    """TRL's default is colocate (the engine in the trainer's process): a GRPOConfig with use_vllm and no vllm_mode
    runs that way, as does a trl.GRPOConfig; 'server' is honoured; without vLLM it is said to be ignored."""
    import warnings

    import trl

    from tandem.services.app.trainer import GRPOConfig

    assert GRPOConfig(str(tmp_path), use_vllm=True).job_sections["cluster"] == {"vllm_mode": "colocate"}
    assert GRPOConfig(str(tmp_path), use_vllm=True, vllm_mode="server").job_sections["cluster"]["vllm_mode"] == "server"
    with pytest.warns(UserWarning, match=r"ignored .*vllm_mode \(use_vllm=False: TRL generates in its own process"):
        assert "cluster" not in GRPOConfig(str(tmp_path), vllm_mode="server").job_sections
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True)
        assert GRPOConfig.from_any(theirs, "x").job_sections["cluster"]["vllm_mode"] == "colocate"
    assert GRPOConfig(str(tmp_path), logging_steps=5).logging_steps == 5  # a callback reads TRL's names
    assert GRPOConfig(str(tmp_path)).save_total_limit is None  # TRL's default where not given
    with pytest.raises(AttributeError, match="no attribute 'lerning_rate'"):
        _ = GRPOConfig(str(tmp_path)).lerning_rate


def test_a_failed_run_is_the_python_error_of_its_cause():
    """The root cause's TandemError class and first line, the traceback as the cause's text; anything else a
    TrainingError; the job file's words for resuming and overwriting in the Python caller's."""
    from tandem.core.errors import JobConfigError, RewardContractError, TandemError, TrainingError
    from tandem.services.app.python_errors import ActorTraceback, as_python_error

    def raised(e):
        try:
            raise e
        except Exception as caught:  # noqa: BLE001
            return caught

    class Wrapper(Exception):  # as Ray's RayTaskError: the user's error as .cause
        def __init__(self, cause):
            super().__init__("\x1b[36mray::Controller.step()\x1b[39m\nTraceback (most recent call last):\n  ...\n"
                             + str(cause))
            self.cause = cause

    inner = RewardContractError("reward function 'short' on dataset row(s) [3]: must return a list of 4 floats")
    err = as_python_error(raised(Wrapper(inner)))
    assert type(err) is RewardContractError and isinstance(err, TandemError)
    assert str(err) == str(inner)
    assert isinstance(err.__cause__, ActorTraceback) and "\x1b[" not in str(err.__cause__)
    assert "ray::Controller.step()" in str(err.__cause__)
    other = as_python_error(raised(ZeroDivisionError("division by zero")))
    assert type(other) is TrainingError and str(other) == "ZeroDivisionError: division by zero"
    refused = as_python_error(raised(JobConfigError(
        "logging.output_dir = 'r': holds an earlier run (x); allowed: checkpoint.resume: true to continue it, "
        "logging.overwrite_output_dir: true to start over there, or another directory")))
    assert str(refused) == ("GRPOConfig.output_dir = 'r': holds an earlier run (x); allowed: "
                            "train(resume_from_checkpoint=True) to continue it, GRPOConfig(overwrite_output_dir=True) "
                            "to start over there, or another directory")


def test_push_to_hub_without_a_token_is_one_line_naming_what_it_needs(hub_cache, tmp_path, monkeypatch):
    """Online but with no token anywhere: refused before anything is written or sent, naming where a token may come
    from (offline is the integration test's case)."""
    from huggingface_hub import constants

    from tandem import GRPOConfig, GRPOTrainer
    from tandem.core.errors import JobConfigError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # huggingface_hub's switch, read once at its import
    monkeypatch.delenv("HF_TOKEN", raising=False)  # and no token file: HF_HOME is the session's own (conftest)
    trainer = GRPOTrainer(model=hub_cache["model"], reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=GRPOConfig(output_dir=str(tmp_path / "run"), bf16=False),
                          train_dataset=[{"prompt": "1 + 1"}])
    with pytest.raises(JobConfigError, match=r"^push_to_hub\(\): no Hugging Face token; allowed: `hf auth login`, "
                                             r"HF_TOKEN, GRPOConfig\(hub_token=...\), or push_to_hub\(token=...\)$"):
        trainer.push_to_hub()
    assert not (tmp_path / "run").exists()


def test_a_trl_checkpoint_is_written_without_torch_and_loads_as_transformers_state(tmp_path):
    """write_trl_checkpoint runs in the controller, which never imports torch: it writes checkpoint-N (the adapter, the
    tokenizer files, trainer_state.json last) in a process that imports neither torch nor transformers, and
    transformers' own TrainerState.load_from_json reads the state back; save_total_limit keeps the newest."""
    import json
    import subprocess
    import sys

    from transformers import TrainerState

    ck = tmp_path / "run" / "checkpoints"
    for step in (2, 4):
        (ck / f"cycle-00000{step}" / "adapter").mkdir(parents=True)
        (ck / f"cycle-00000{step}" / "adapter" / "adapter_config.json").write_text("{}")
        (ck / f"cycle-00000{step}" / "tandem.json").write_text(json.dumps({"steps": step}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1 * s, "lr": 1e-3}) + "\n"
                                                    for s in (1, 2, 3, 4)))
    code = f"""
import json, sys
from pathlib import Path
from tandem.core.config import JobConfig
from tandem.services.orchestrator.trl_checkpoint import Epochs, write_trl_checkpoint
cfg = JobConfig.from_dict({{"model": {{"path": {str(tmp_path / "model")!r}}}, "data": {{"path": "d.jsonl"}},
                           "rewards": ["r.py:f"], "logging": {{"output_dir": {str(tmp_path / "run")!r}}},
                           "checkpoint": {{"save_total_limit": 1}}}})
lines = [json.loads(x) for x in Path({str(tmp_path / "metrics.jsonl")!r}).read_text().splitlines()]
for step in (2, 4):
    write_trl_checkpoint({str(ck)!r} + f"/cycle-00000{{step}}", cfg, lines, 8, Epochs(2, 4, 16))
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []
    out = tmp_path / "run"
    assert sorted(x.name for x in out.glob("checkpoint-*")) == ["checkpoint-4"]  # save_total_limit 1
    assert sorted(x.name for x in (out / "checkpoint-4").iterdir()) == [
        "adapter_config.json", "tandem_checkpoint", "tokenizer.json", "trainer_state.json"]
    state = TrainerState.load_from_json(str(out / "checkpoint-4" / "trainer_state.json"))
    assert (state.global_step, state.max_steps, state.epoch) == (4, 8, 0.5)
    assert [r["step"] for r in state.log_history] == [1, 2, 3, 4] and state.log_history[0]["learning_rate"] == 1e-3


def test_callbacks_see_each_step_once_as_the_file_grows_and_after_a_restart_cuts_it(tmp_path):
    """RunEvents reads what metrics.jsonl gained since the last cycle: a line half written waits for the next call;
    a file a restart cut back and rewrote reports only the steps not reported yet (retrained steps once)."""
    import json
    from types import SimpleNamespace

    from transformers import TrainerCallback, TrainerState

    from tandem.services.app.callbacks import Callbacks, RunEvents

    seen = []

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(("step", state.global_step))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.append(("eval", metrics["step"]))

    cfg = SimpleNamespace(run_dir=str(tmp_path), rewards=["r.py:f"], logging=SimpleNamespace(output_dir=str(tmp_path)))
    events = RunEvents(Callbacks([Recorder]), None, TrainerState(), cfg, None)
    metrics = tmp_path / "metrics.jsonl"

    def write(lines, mode="a", tail=""):
        with open(metrics, mode) as f:
            f.write("".join(json.dumps(x) + "\n" for x in lines) + tail)
    write([{"step": 0, "eval/reward": 0.1}, {"step": 1, "loss": 1.0}], tail='{"step": 2, "lo')
    events.after_cycle()
    write([], tail='ss": 2.0}\n')
    events.after_cycle()
    write([{"step": 0, "eval/reward": 0.1}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.5},
           {"step": 3, "loss": 3.0}], mode="w")  # cut back to step 1, steps 2 and 3 trained again
    events.after_cycle()
    assert seen == [("eval", 0), ("step", 1), ("step", 2), ("step", 3)]
    assert [r["step"] for r in events.state.log_history] == [0, 1, 2, 3]


def test_log_history_carries_trls_keys_and_numbers_only():
    """What a logger reads from `trainer.state.log_history`: TRL's `num_tokens` (the trained tokens so far), `step_time`,
    `completions/*_terminated_length`, `clip_ratio/low_min` and `clip_ratio/high_max`, and no dict (staleness_hist),
    None (learner/mfu off a GPU) or text among the values."""
    lines = [{"step": 1, "loss": 0.5, "tokens": 30.0, "cycle_s": 0.2, "staleness_hist": {"0": 4}, "learner/mfu": None,
              "completion_length_terminated": 7.0, "completion_length_terminated_min": 3.0,
              "completion_length_terminated_max": 9.0, "clip_ratio/low_mean": 0.1, "clip_ratio/high_mean": 0.2},
             {"step": 2, "loss": 0.4, "tokens": 20.0, "cycle_s": 0.3}]
    rows = log_history(lines, ["r"], None)
    first, second = rows
    assert (first["num_tokens"], second["num_tokens"]) == (30.0, 50.0) and first["step_time"] == 0.2
    assert (first["completions/mean_terminated_length"], first["completions/min_terminated_length"],
            first["completions/max_terminated_length"]) == (7.0, 3.0, 9.0)
    assert (first["clip_ratio/low_min"], first["clip_ratio/high_max"]) == (0.1, 0.2)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for r in rows for v in r.values())
    assert "staleness_hist" not in first and "learner/mfu" not in first


def test_a_callback_that_raises_is_named_with_its_hook():
    """TRL lets a callback's error out as it is; Tandem names the callback and the hook (the line `train()` raises),
    the callback's own error kept as the cause."""
    from transformers import TrainerCallback, TrainerControl, TrainerState

    from tandem.core.errors import TrainingError
    from tandem.services.app.callbacks import Callbacks

    class Quiet(TrainerCallback):
        pass

    class Boom(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            raise KeyError("reward")

    cbs = Callbacks([Quiet, Boom])
    control = TrainerControl()
    assert cbs.fire("on_step_end", None, TrainerState(), control) is control  # hooks it lacks: nothing
    with pytest.raises(TrainingError, match=r"^callbacks: Boom.on_log raised KeyError: 'reward'$") as e:
        cbs.fire("on_log", None, TrainerState(), control, logs={"loss": 1.0})
    assert isinstance(e.value.__cause__, KeyError)


def test_push_to_hub_with_the_hub_unreachable_is_one_tandem_error_naming_the_repo(hub_cache, tmp_path, monkeypatch):
    """A token, the Hub switched on, and no route to it (a closed port as the endpoint): huggingface_hub's transport
    error becomes one line naming the endpoint and the repo, nothing written or sent."""
    from huggingface_hub import constants

    from tandem import GRPOConfig, GRPOTrainer, TandemError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    trainer = GRPOTrainer(model=hub_cache["model"], reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=GRPOConfig(output_dir=str(tmp_path / "run"), bf16=False, hub_model_id="me/tiny-grpo"),
                          train_dataset=[{"prompt": "1 + 1"}])
    with pytest.raises(TandemError, match=r"^push_to_hub\(\): the Hugging Face Hub \(http://127.0.0.1:9\) cannot be "
                                          r"reached for repo 'me/tiny-grpo' \(\w+: .*\); nothing was uploaded; "
                                          r"allowed: a machine that reaches the Hub") as e:
        trainer.push_to_hub(token="hf_test")
    assert e.value.__cause__ is not None and not (tmp_path / "run").exists()
