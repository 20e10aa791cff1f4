"""The front door without a job running: Hub names resolved through a real huggingface_hub / datasets cache offline
(tests/conftest.py: hub_cache), rows shaped by data.map and data.system_prompt, TRL's constructor arguments mapped or
refused by name, functions pickled by value."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tandem.core.config import JobConfig, JobConfigError


def hub_job(hub_cache, tmp_path, **sections):
    d = {"model": {"path": hub_cache["model"], "dtype": "float32"}, "data": {"path": hub_cache["dataset"],
         "name": "plain", "prompt_column": "question"}, "rewards": ["examples/rewards.py:digits_reward"],
         "logging": {"output_dir": str(tmp_path / "run")}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return JobConfig.from_dict(d)


# ------------------------------------------------------------------------------------------ models


def test_a_hub_model_id_is_its_cached_snapshot_at_the_revision_asked(hub_cache, tmp_path):
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    from tandem.core.checks import model_error
    from tandem.core.hub import model_dir

    snapshots = os.path.join(constants.HF_HUB_CACHE, "models--tandem-test--tiny", "snapshots")
    assert model_dir(hub_cache["model"]) == os.path.join(snapshots, hub_cache["main"])
    assert model_dir(hub_cache["model"], "v2") == os.path.join(snapshots, hub_cache["v2"])  # a branch
    assert model_dir(hub_cache["model"], hub_cache["v2"]) == os.path.join(snapshots, hub_cache["v2"])  # a commit
    main, v2 = (AutoModelForCausalLM.from_pretrained(model_dir(hub_cache["model"], r)) for r in (None, "v2"))
    assert not main.model.embed_tokens.weight.equal(v2.model.embed_tokens.weight)  # two seeds: two models
    cfg = hub_job(hub_cache, tmp_path, model={"revision": "v2"})
    assert model_error(cfg) is None and cfg.model.local_dir() == os.path.join(snapshots, hub_cache["v2"])


@pytest.mark.parametrize("model", [{"path": "tandem-test/missing"}, {"revision": "v9"}])
def test_a_hub_model_not_in_the_cache_is_one_line_naming_it_and_the_cache(hub_cache, tmp_path, capsys, model):
    """`tandem check` (what `tandem run` checks first): exit 2, one line with the name, revision and cache."""
    import yaml
    from huggingface_hub import constants

    from tandem.services.app.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(hub_job(hub_cache, tmp_path, model=model).model_dump(mode="json")))
    assert main(["check", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and constants.HF_HUB_CACHE in err and "HF_HUB_OFFLINE" in err
    assert f"model.path = {model.get('path', hub_cache['model'])!r}" in err
    assert ("revision 'v9'" in err) == ("revision" in model)


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(hub_cache, tmp_path, monkeypatch):
    from tandem.core.hub import is_hub_id, model_dir

    monkeypatch.chdir(tmp_path)
    assert is_hub_id("tandem-test/tiny")
    (tmp_path / "tandem-test" / "tiny").mkdir(parents=True)
    assert not is_hub_id("tandem-test/tiny") and model_dir("tandem-test/tiny", "v2") == "tandem-test/tiny"


# ---------------------------------------------------------------------------------------- datasets


def test_a_hub_dataset_is_read_by_name_configuration_and_split(hub_cache):
    from tandem.services.orchestrator.data import read_dataset

    train = read_dataset("data.path", hub_cache["dataset"], "plain", "train")
    assert train == [{"question": f"{a} + {a}", "answer": 2 * a} for a in range(16)]
    assert len(read_dataset("eval.path", hub_cache["dataset"], "plain", "test")) == 4
    with pytest.raises(JobConfigError, match=r"data.path = 'tandem-test/arith' \(name 'plain', split 'dev'\).*"
                                             r"\['train', 'test'\]"):
        read_dataset("data.path", hub_cache["dataset"], "plain", "dev")


def test_a_hub_dataset_not_in_the_cache_is_one_line_naming_it_and_the_cache(hub_cache):
    import datasets

    from tandem.services.orchestrator.data import read_dataset

    with pytest.raises(JobConfigError) as e:
        read_dataset("eval.path", "tandem-test/nowhere", None, "test")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("eval.path = 'tandem-test/nowhere': no local path")
    assert str(datasets.config.HF_DATASETS_CACHE) in msg and "HF_HUB_OFFLINE" in msg


def test_without_a_route_to_the_hub_the_cache_is_read_at_once_and_a_miss_is_one_line(hub_cache, tmp_path):
    """HF_HUB_OFFLINE not set on a machine that cannot reach the Hub (HF_ENDPOINT a closed port): the cached model and
    dataset are read from the cache and an uncached id is one line saying the Hub cannot be reached, in seconds, with
    no retry lines."""
    code = textwrap.dedent(f"""
        import time
        from tandem.core.config import JobConfigError
        from tandem.core.hub import model_dir
        from tandem.services.orchestrator.data import read_dataset
        t0 = time.time()
        assert model_dir({hub_cache["model"]!r}).endswith({hub_cache["main"]!r})
        assert len(read_dataset("data.path", {hub_cache["dataset"]!r}, "plain", "train")) == 16
        for read in (lambda: read_dataset("data.path", "tandem-test/nowhere", None, "train"),
                     lambda: model_dir("tandem-test/nothing")):
            try:
                read()
            except JobConfigError as e:
                print(e)
        print(f"seconds {{time.time() - t0:.1f}}")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout.strip().splitlines()
    assert len(out) == 3 and all("the Hub (http://127.0.0.1:9) cannot be reached from this node" in x for x in out[:2])
    assert out[0].startswith("data.path = 'tandem-test/nowhere'") and out[1].startswith("model.path = 'tandem-test/")
    assert float(out[2].split()[1]) < 10 and "Retrying" not in p.stderr, p.stderr[-2000:]


def test_map_and_system_prompt_shape_every_row_and_keep_its_columns(hub_cache, tmp_path):
    from transformers import AutoTokenizer

    from tandem.core.hub import model_dir
    from tandem.services.orchestrator.data import DataError, shaped

    (tmp_path / "shape.py").write_text(textwrap.dedent('''
        def to_chat(row):
            return {"prompt": [{"role": "user", "content": "Q: " + row["question"]}], "n": len(row["question"])}
        def broken(row):
            return None
    '''))
    tok = AutoTokenizer.from_pretrained(model_dir(hub_cache["model"]))
    rows = [{"question": "1 + 1", "answer": 2}, {"question": "2 + 2", "answer": 4}]
    cfg = hub_job(hub_cache, tmp_path, data={"map": f"{tmp_path}/shape.py:to_chat", "system_prompt": "Be brief.",
                                              "prompt_column": "prompt"})
    got = shaped(rows, cfg.data, tok, "data.path")
    assert got[1] == {"question": "2 + 2", "answer": 4, "n": 5, "prompt": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 2 + 2"}]}
    assert rows[1] == {"question": "2 + 2", "answer": 4}  # the rows read are not changed in place
    # a string prompt becomes a system and a user turn; a conversation with its own system message keeps it
    text = cfg.data.model_copy(update={"map": None, "prompt_column": "question"})
    assert shaped(rows, text, tok, "x")[0]["question"] == [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "1 + 1"}]
    own = [{"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]}]
    assert shaped(own, cfg.data.model_copy(update={"map": None}), tok, "x") == own
    tok.chat_template = None
    with pytest.raises(DataError, match="data.system_prompt with x row 0's string prompt: .* no chat template"):
        shaped(rows, text, tok, "x")
    with pytest.raises(DataError, match=r"data.map = '.*shape.py:broken' on x row 0 returned NoneType"):
        shaped(rows, cfg.data.model_copy(update={"map": f"{tmp_path}/shape.py:broken"}), tok, "x")


# ------------------------------------------------------------------------------------- TRL's front


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_trl_arguments_become_the_job_a_peft_model_gives_its_lora(hub_cache, tmp_path):
    import trl
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tandem import GRPOConfig, GRPOTrainer
    from tandem.core.hub import model_dir

    rows = [{"prompt": "1 + 1", "answer": 2}]
    args = trl.GRPOConfig(output_dir=str(tmp_path / "a"), bf16=False, learning_rate=1e-4, max_steps=3,
                          num_generations=4, per_device_train_batch_size=4, max_completion_length=16)
    t = GRPOTrainer(model=hub_cache["model"], reward_funcs=[reward_len, "examples/rewards.py:digits_reward"],
                    args=args, train_dataset=rows, peft_config=LoraConfig(r=4, lora_alpha=8,
                                                                          target_modules=["q_proj", "v_proj"]))
    job = t.job
    assert (job.model.path, job.model.dtype, job.model.lora.r, job.model.lora.target_modules) == (
        "tandem-test/tiny", "float32", 4, ["q_proj", "v_proj"])
    assert (job.optimizer.learning_rate, job.batch.max_steps, job.generation.max_completion_length) == (1e-4, 3, 16)
    assert job.rewards == [f"{tmp_path}/a/.tandem/functions.pkl:reward_len",
                           f"{os.getcwd()}/examples/rewards.py:digits_reward"]
    assert job.data.path is None and t.datasets == {"data": rows}
    # an Unsloth-style PeftModel: its base's name and its LoraConfig; Tandem's own sections beside TRL's names
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir(hub_cache["model"])),
                          LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    peft.get_base_model().name_or_path = hub_cache["model"]  # as from_pretrained("tandem-test/tiny") names it
    t = GRPOTrainer(model=peft, reward_funcs=reward_len, train_dataset=rows, args=GRPOConfig(
        output_dir=str(tmp_path / "b"), bf16=False, cluster={"max_staleness": 1}))
    assert (t.job.model.path, t.job.model.lora.r, t.job.cluster.max_staleness) == ("tandem-test/tiny", 2, 1)
    assert len(t.job.model.lora.target_modules) == 7
    # no peft_config and a plain model: full fine-tuning, as TRL
    assert GRPOTrainer(model=hub_cache["model"], reward_funcs=reward_len, train_dataset=rows,
                       args={"output_dir": str(tmp_path / "c"), "bf16": False}).job.model.lora is None


def test_what_tandem_does_not_do_is_refused_by_name(hub_cache, tmp_path):
    import datasets
    from peft import LoraConfig

    from tandem import GRPOConfig, GRPOTrainer

    rows = [{"prompt": "1 + 1"}]
    kw = dict(model=hub_cache["model"], reward_funcs=reward_len, train_dataset=rows,
              args=GRPOConfig(output_dir=str(tmp_path / "r"), bf16=False))
    with pytest.raises(JobConfigError, match="not supported by Tandem .*: use_liger_loss=True"):
        GRPOConfig(output_dir="x", use_liger_loss=True)
    with pytest.raises(JobConfigError, match=r"GRPOTrainer\(optimizers=...\): not supported by Tandem: Tandem's learner"):
        GRPOTrainer(**kw, optimizers=(object(), None))
    with pytest.raises(JobConfigError, match=r"callbacks=\[object\]: not a transformers TrainerCallback"):
        GRPOTrainer(**kw, callbacks=[object()])
    with pytest.raises(JobConfigError, match="reward model"):
        GRPOTrainer(**{**kw, "reward_funcs": "org/reward-model"})
    with pytest.raises(JobConfigError, match="use_dora=True"):
        GRPOTrainer(**kw, peft_config=LoraConfig(use_dora=True))
    ds = datasets.Dataset.from_list(rows)
    with pytest.raises(JobConfigError, match=r"IterableDataset\): Tandem shuffles and resumes by row"):
        GRPOTrainer(**{**kw, "train_dataset": ds.to_iterable_dataset()})
    with pytest.raises(JobConfigError, match=r"DatasetDict of \['train'\]\): one split; allowed: e.g. ds\['train'\]"):
        GRPOTrainer(**{**kw, "train_dataset": datasets.DatasetDict({"train": ds})})
    assert GRPOTrainer(**{**kw, "train_dataset": ds}).datasets["data"] == rows  # a Dataset is its rows
    import threading

    lock = threading.Lock()

    def guarded(completions, **kwargs):  # a closure over a lock: nothing a worker process can receive
        with lock:
            return [0.0] * len(completions)
    with pytest.raises(TypeError, match=r"GRPOTrainer\(reward_funcs=...\): test_what_tandem_does_not_do_is_refused_by_"
                                        r"name.<locals>.guarded cannot be sent to the rollout workers, .*lock"):
        GRPOTrainer(**{**kw, "reward_funcs": [reward_len, guarded]})
    with pytest.raises(TypeError, match=r"GRPOTrainer\(tools=...\): .*guarded cannot be sent"):
        GRPOTrainer(**kw, tools=[guarded])


def test_a_tokenizer_changed_in_memory_is_refused(hub_cache, tmp_path):
    from transformers import AutoTokenizer

    from tandem import GRPOTrainer
    from tandem.core.hub import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir(hub_cache["model"]))
    kw = dict(model=hub_cache["model"], reward_funcs=reward_len, train_dataset=[{"prompt": "1"}],
              args={"output_dir": str(tmp_path / "t"), "bf16": False})
    GRPOTrainer(**kw, processing_class=tok)  # the model's own: taken
    tok.chat_template = "{{ messages[0]['content'] }}"  # what an Unsloth notebook's get_chat_template does
    with pytest.raises(JobConfigError, match="processing_class=...\\): differs from the tokenizer saved with model "
                                             "'tandem-test/tiny'"):
        GRPOTrainer(**kw, processing_class=tok)


def test_functions_made_in_a_process_load_by_value_where_their_module_cannot_be_imported(tmp_path):
    """A closure over a local, calling a helper of this test module: pickled by value, it runs in a fresh
    interpreter that cannot import `tests` (another directory, no path to this repository's tests); written to and
    read from a run directory that is a storage URI, as every node reads it there."""
    from tandem.services.app.trainer import FUNCTIONS_FILE, write_functions

    bonus = 0.5

    def reward_closure(completions, **kwargs):
        return [v + bonus for v in reward_len(completions)]
    run = f"file://{tmp_path}/run"
    write_functions(run, {"reward_closure": reward_closure})
    code = ("import sys; from tandem.core.loader import load_function; "
            "assert 'tests' not in sys.modules; "
            f"print(load_function({run + '/' + FUNCTIONS_FILE + ':reward_closure'!r})(completions=['ab', 'abcd']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip()) == [2.5, 4.5]


def test_trls_async_config_is_refused_by_name_and_its_own_names_say_where_they_live_in_tandem(tmp_path):
    """TRL's AsyncGRPOConfig as args is refused, naming it and what is allowed: its trainer's loss and defaults are
    not GRPOConfig's, and the generic TRL path would drop its max_staleness of 4 (a default, so not a changed field)
    and train other numbers. Each of its own names given to a GRPOConfig, or in a job file's trl: section, is refused
    with the place Tandem has for it; every field the installed AsyncGRPOConfig adds to GRPOConfig's is one of them."""
    import dataclasses
    import warnings

    from tandem.core.trl import ASYNC_ONLY, trl_to_sections
    from tandem.services.app.trainer import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import trl
        from trl.experimental.async_grpo import AsyncGRPOConfig

        async_args = AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(JobConfigError, match=r"GRPOTrainer\(args=AsyncGRPOConfig\(\.\.\.\)\).*max_staleness 4.*allowed: "
                       r"a trl\.GRPOConfig or tandem\.GRPOConfig.*cluster=\{'max_staleness': N\}"):
        GRPOConfig.from_any(async_args, str(tmp_path))
    with pytest.raises(TypeError, match=r"^GRPOConfig.__init__\(\) got an unexpected keyword argument 'max_staleness' "
                       r"\(max_staleness is TRL's AsyncGRPOConfig's; in Tandem: cluster=\{'max_staleness': N\}"):
        GRPOConfig(str(tmp_path), max_staleness=4)
    with pytest.raises(JobConfigError, match=r"max_inflight_tasks=512 \(unknown GRPOConfig name; max_inflight_tasks is "
                       r"TRL's AsyncGRPOConfig's; in Tandem: cluster=\{'rollout_prompts_in_flight': N\}"):
        trl_to_sections({"max_inflight_tasks": 512})
    grpo = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    own = {f.name for f in dataclasses.fields(AsyncGRPOConfig)} - grpo
    assert own and own <= set(ASYNC_ONLY), own - set(ASYNC_ONLY)


def test_a_name_trls_grpoconfig_lacks_is_pythons_type_error_and_every_name_it_has_is_classed(tmp_path):
    """tandem.GRPOConfig (and a dict given as args) refuses an unknown keyword as TRL's dataclass does: TypeError,
    naming it. Every field of the installed TRL's GRPOConfig is one Tandem maps, checks, ignores or refuses by
    name, never "unknown" (the walk fails when a TRL release adds a field nobody classed). A job file's `trl:`
    names stay a JobConfigError naming the field."""
    import dataclasses
    import warnings

    from tandem.core.trl import _sections
    from tandem.services.app.trainer import GRPOConfig

    with pytest.raises(TypeError, match=r"^GRPOConfig.__init__\(\) got an unexpected keyword argument 'lerning_rate'$"):
        GRPOConfig(str(tmp_path), lerning_rate=1e-5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_genrations'"):
        GRPOConfig.from_any({"num_genrations": 4}, str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import trl

        defaults = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    unclassed = [f.name for f in dataclasses.fields(trl.GRPOConfig)
                 if _sections({f.name: getattr(defaults, f.name)})[3]]
    assert unclassed == [], unclassed
    assert len(dataclasses.fields(trl.GRPOConfig)) > 150  # the walk saw TRL's fields, not an empty class
    with pytest.raises(JobConfigError, match=r"lerning_rate=1e-05 \(unknown GRPOConfig name\)"):
        JobConfig.from_trl({"lerning_rate": 1e-5}, model={"path": "m"}, data={"path": "d.jsonl"}, rewards=["r.py:f"])


def test_every_error_the_docs_name_is_importable_from_tandem_and_caught_as_tandem_error():
    """docs/trl.md promises `tandem.TandemError` and names its subclasses: each is `from tandem import X`, each is a
    TandemError, and `except tandem.TandemError` catches what a bad job raises (not an AttributeError that hides it)."""
    import re

    import tandem
    from tests.helpers import ROOT

    text = (ROOT / "docs" / "trl.md").read_text()
    said = re.search(r"`tandem\.TandemError` subclass \(([^)]*)\)", text).group(1)
    names = re.findall(r"`(\w+Error)`", said)
    assert len(names) >= 5, names
    for name in ["TandemError", *names]:
        assert issubclass(getattr(tandem, name), tandem.TandemError), name
    with pytest.raises(tandem.TandemError, match="batch.num_generations"):
        JobConfig.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "rewards": ["r:f"],
                             "batch": {"num_generations": 1}})
    # importing the errors stays light: no torch, no transformers
    code = "import sys, tandem; from tandem import TandemError; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
