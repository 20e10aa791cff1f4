"""`from tandem import GRPOTrainer, GRPOConfig`: TRL's constructor, `.train()` running the job `tandem run` runs, and
what a TRL script does after it (`save_model`, `push_to_hub`, `state`, `model`, `evaluate`, callbacks).

A TRL or Unsloth script changes its import and runs on Ray: the arguments become a JobConfig (TRL's names through
`JobConfig.from_trl`, Tandem's own sections as dicts), functions made in the user's process (reward functions, tools,
an environment class; closures and notebook cells included) are pickled by value into the run directory, which every
node reads, and the datasets go to the controller through Ray's object store, once. A failed run is the
tandem.TandemError subclass of its cause (services/app/python_errors.py).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from tandem.core.config import JobConfig, JobConfigError, with_absolute_paths
from tandem.core.errors import TandemError
from tandem.core.storage import Location, Store, is_uri, join
from tandem.core.trl import trl_to_sections
from tandem.services.app.callbacks import Callbacks, RunEvents
from tandem.services.orchestrator.run_log import read_lines
from tandem.services.orchestrator.trl_checkpoint import (
    POINTER,
    Epochs,
    log_history,
    reward_names,
    tandem_checkpoint,
    trl_checkpoints,
    write_tokenizer_files,
)

# Tandem's sections a GRPOConfig takes as dicts (what TRL has no name for: workers, staleness, resources, ...)
SECTIONS = ("model", "data", "generation", "batch", "grpo", "optimizer", "cluster", "checkpoint", "logging", "eval")
TOP_LEVEL = ("reward_timeout_s", "tool_timeout_s")
FUNCTIONS_FILE = ".tandem/functions.pkl"  # in the run directory
# GRPOTrainer arguments of TRL that Tandem does not take, refused by name when given
REFUSED = {
    "reward_processing_classes": "reward models are not supported (reward functions are)",
    "optimizers": "Tandem's learner builds its AdamW and schedule from the optimizer section",
    "quantization_config": "quantized training (QLoRA) is not supported",
    "rollout_func": "custom rollout functions are not supported; tools= and environment_factory= are",
}


# TRL's AsyncGRPOConfig as args: its trainer's loss and defaults are not GRPOConfig's, and a silent mapping would train
# other numbers than the script's (its trl/experimental/async_grpo/async_grpo_trainer.py compute_loss, and the rollout
# worker's advantages)
ASYNC_REFUSAL = (
    "GRPOTrainer(args=AsyncGRPOConfig(...)): TRL's AsyncGRPOTrainer trains another loss than its GRPOTrainer (the "
    "ratio to the sampler's log-probs, clipped, with no separate old policy or importance weight; advantages over the "
    "group's population std; each micro-batch's token mean) under other defaults (max_staleness 4, "
    "max_completion_length 2048, dtype float32), which Tandem does not reproduce; allowed: a trl.GRPOConfig or "
    "tandem.GRPOConfig of the same run, with cluster={'max_staleness': N} for TRL's staleness bound (docs/trl.md, "
    "\"From TRL's AsyncGRPOTrainer\")")


class TrainOutput(NamedTuple):
    """What transformers' Trainer.train returns: the last step, the mean training loss, and its metrics (train_runtime,
    train_samples_per_second, train_steps_per_second, total_flos, train_loss, epoch)."""
    global_step: int
    training_loss: float
    metrics: dict


class GRPOConfig:
    """TRL's `GRPOConfig(output_dir, **kwargs)`: TRL's names (as `JobConfig.from_trl` maps them; what changes training
    and Tandem does not implement is refused by name, here), and Tandem's own sections as dicts, e.g.
    `cluster={"max_staleness": 1, "num_rollout_workers": 2}`."""

    def __init__(self, output_dir: str | None = None, **kwargs: Any):
        self.output_dir = output_dir
        self.sections = {k: kwargs.pop(k) for k in list(kwargs) if k in SECTIONS + TOP_LEVEL}
        for k, v in self.sections.items():
            if k in SECTIONS and not isinstance(v, dict):
                raise JobConfigError(f"GRPOConfig({k}={v!r}): Tandem's {k} section is a dict of its fields")
        self.trl = kwargs
        # refused now, as TRL's constructor refuses; a name TRL lacks is the TypeError its dataclass raises
        self.job_sections = trl_to_sections(self._flat(), caller="GRPOConfig.__init__()")

    def _flat(self) -> dict:
        return {**self.trl, **({"output_dir": self.output_dir} if self.output_dir is not None else {})}

    def __repr__(self) -> str:
        return f"tandem.GRPOConfig(output_dir={self.output_dir!r}, {self.trl}, sections={self.sections})"

    def __getattr__(self, name: str) -> Any:
        """A TRL name as TRL's config answers it (a callback reads `args.logging_steps`): the value given, else the
        installed TRL's default."""
        trl = self.__dict__.get("trl", {})
        if name in trl:
            return trl[name]
        default = trl_field_default(name)
        if default is MISSING:
            raise AttributeError(f"'GRPOConfig' object has no attribute {name!r}")
        return default

    @classmethod
    def from_any(cls, args: Any, default_output_dir: str) -> GRPOConfig:
        """A tandem.GRPOConfig, a trl.GRPOConfig (the fields it sets away from TRL's defaults), a dict, or None."""
        if args is None:
            return cls(default_output_dir)
        if isinstance(args, cls):
            return args if args.output_dir is not None else cls(default_output_dir, **args.trl, **args.sections)
        if isinstance(args, dict):
            return cls(**{"output_dir": default_output_dir, **args})
        if dataclasses.is_dataclass(args) and hasattr(args, "max_staleness") and hasattr(args, "weight_sync_steps"):
            raise JobConfigError(ASYNC_REFUSAL)
        if dataclasses.is_dataclass(args) and hasattr(args, "num_generations"):  # trl.GRPOConfig
            return cls(**changed_fields(args))
        raise JobConfigError(f"GRPOTrainer(args={type(args).__name__}): allowed: tandem.GRPOConfig, trl.GRPOConfig, "
                             "a dict of their names, or None")


MISSING = object()


def trl_field_default(name: str) -> Any:
    """The installed TRL GRPOConfig's default for `name`, or MISSING (no such field, or no TRL installed)."""
    try:
        import trl
    except ImportError:
        return MISSING
    f = next((f for f in dataclasses.fields(trl.GRPOConfig) if f.name == name and not name.startswith("_")), None)
    if f is None:
        return MISSING
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING


def changed_fields(args: Any) -> dict:
    """A TRL config's fields set away from a fresh one's defaults (TRL's defaults for the rest are from_trl's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precision = {k: getattr(args, k) for k in ("bf16", "fp16", "use_cpu")}  # TRL's bf16 default needs a GPU
        fresh = type(args)(output_dir=args.output_dir, **precision)

    def plain(v):
        return v.value if isinstance(v, enum.Enum) else v
    out = {"output_dir": args.output_dir, "bf16": bool(args.bf16), "fp16": bool(args.fp16)}
    for f in dataclasses.fields(args):
        if f.init and plain(getattr(args, f.name)) != plain(getattr(fresh, f.name)):
            out[f.name] = plain(getattr(args, f.name))
    return out


class GRPOTrainer:
    """TRL's `GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, peft_config, tools,
    environment_factory)`; `.train()` runs the job on an embedded Ray (`address=` joins a cluster) and returns
    TrainOutput. `model`: a Hub id or local path, or a loaded transformers / peft model (its name_or_path; a
    PeftModel's LoraConfig, as an Unsloth notebook passes it): every node loads the model by that name."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None, tools: Any = None,
                 environment_factory: Any = None, callbacks: list | None = None, address: str | None = None,
                 **trl_only: Any):
        for name, value in trl_only.items():
            if name not in REFUSED:
                raise TypeError(f"GRPOTrainer() got an unexpected keyword argument {name!r}")
            if value not in (None, (None, None), [], ()):
                raise JobConfigError(f"GRPOTrainer({name}=...): not supported by Tandem: {REFUSED[name]}")
        path, lora = model_and_lora(model, peft_config)
        self.args = GRPOConfig.from_any(args, f"{path.rstrip('/').split('/')[-1]}-GRPO")
        out = str(self.args.output_dir) if is_uri(self.args.output_dir) else str(Path(self.args.output_dir).absolute())
        self.functions: dict[str, Any] = {}
        pkl = join(out, FUNCTIONS_FILE)  # on a storage URI every node reads it there
        job: dict[str, Any] = {
            "rewards": [self._spec(f, "reward_funcs", pkl) for f in as_list(reward_funcs, "reward_funcs")],
            "model": {"path": path, "lora": lora},
            "data": {"path": None},
        }
        if tools:
            job["tools"] = [self._spec(f, "tools", pkl) for f in as_list(tools, "tools")]
        if environment_factory is not None:
            if not isinstance(environment_factory, type):
                raise JobConfigError("GRPOTrainer(environment_factory=...): a class (its methods are the tools, read "
                                     f"from the class), got {type(environment_factory).__name__}")
            job["environment"] = self._spec(environment_factory, "environment_factory", pkl)
        self.datasets = {k: v for k, v in (("data", dataset_rows(train_dataset, "train_dataset")),
                                            ("eval", dataset_rows(eval_dataset, "eval_dataset"))) if v is not None}
        if "data" not in self.datasets:
            raise JobConfigError("GRPOTrainer(train_dataset=None): the prompts are required (a datasets.Dataset or a "
                                 "list of dicts with a 'prompt' column)")
        job = merged(merged(self.args.job_sections, job), self.args.sections)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TRL config: ignored")  # said when the GRPOConfig was made
            self.job = with_absolute_paths(JobConfig.from_dict(job), os.getcwd())
        self.address = address
        check_tokenizer(processing_class, self.job)
        self.callbacks = Callbacks(callbacks)
        self._state, self._model = None, None  # loaded when first asked for

    def _spec(self, fn: Any, arg: str, pkl: str) -> str:
        """A function given by name stays a name; one given as an object is pickled by value under a unique name."""
        if isinstance(fn, str):
            if ":" not in fn:
                raise JobConfigError(f"GRPOTrainer({arg}={fn!r}): a name without ':' is a reward model in TRL, which "
                                     "Tandem does not support; allowed: functions, or 'module:function' names")
            return fn
        if not callable(fn) or hasattr(fn, "forward"):
            raise JobConfigError(f"GRPOTrainer({arg}=...): {type(fn).__name__} is not a function (reward models "
                                 "are not supported)")
        base = getattr(fn, "__name__", type(fn).__name__)
        try:
            pickled({base: fn})
        except Exception as e:  # noqa: BLE001 - cloudpickle raises TypeError, PicklingError, RecursionError...
            raise TypeError(f"GRPOTrainer({arg}=...): {getattr(fn, '__qualname__', base)} cannot be sent to the rollout "
                            f"workers, which run it in processes of their own ({type(e).__name__}: {e}); allowed: a "
                            "function whose closure and globals pickle (make a lock, client or open file inside it, "
                            "or name it as 'module:function')") from None
        name, n = base, 1
        while name in self.functions:
            n += 1
            name = f"{base}_{n}"
        self.functions[name] = fn
        return f"{pkl}:{name}"

    def train(self, resume_from_checkpoint: bool | str | None = None, **trl_only: Any) -> TrainOutput:
        """resume_from_checkpoint (TRL's argument): True, the run's newest `checkpoint-N`, or its Tandem checkpoint,
        continues from it. A failed run raises the tandem.TandemError subclass of its cause, in one line."""
        from tandem.services.app.python_errors import as_python_error

        if unknown := [k for k in trl_only if k not in ("trial", "ignore_keys_for_eval")]:
            raise TypeError(f"train() got an unexpected keyword argument {unknown[0]!r}")
        try:
            return self._train(resume_from_checkpoint)
        except Exception as e:  # noqa: BLE001 - every error of the run becomes a TandemError (Ctrl-C stays itself)
            err = as_python_error(e)
            raise err from err.__cause__

    def _train(self, resume_from_checkpoint: bool | str | None) -> TrainOutput:
        from tandem.core.checks import check_inputs
        from tandem.services.app.run import hold_run_dirs, run_job, start_ray

        cfg = self.job
        if resume_from_checkpoint:
            check_resume_target(resume_from_checkpoint, cfg)
            cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
        with hold_run_dirs(cfg):
            if self.functions:
                write_functions(cfg.logging.output_dir, self.functions)
            check_inputs(cfg, given=set(self.datasets))
            ray = start_ray(self.address or cfg.cluster.address, cfg)
            refs = {k: ray.put(v) for k, v in self.datasets.items()}  # the controller reads them once
            events = RunEvents(self.callbacks, self.args, self.state, cfg, self._epochs())
            events.begin()
            t0 = time.time()
            rc = run_job(cfg, address=self.address or cfg.cluster.address, datasets=refs, events=events)
        if rc == 130:
            raise KeyboardInterrupt("tandem: training interrupted (a checkpoint was saved)")
        self._model = None  # trained since it was loaded
        out = train_output(Path(cfg.run_dir) / "metrics.jsonl", cfg, time.time() - t0, self._epochs())
        events.end(summary={**out.metrics, "step": out.global_step})
        return out

    # --------------------------------------------------------------------------------- after train(), as TRL's

    @property
    def state(self):
        """transformers' TrainerState of the run: global_step, log_history (TRL's names), best_metric None (Tandem
        keeps no "best" model)."""
        if self._state is None:
            from transformers import TrainerState

            lines = read_lines(Path(self.job.run_dir) / "metrics.jsonl")
            from tandem.core.plan import BatchPlan

            epochs, plan, b = self._epochs(), BatchPlan.from_config(self.job), self.job.batch
            total = plan.total_cycles(b.max_steps, b.num_train_epochs, epochs.rows) * plan.optimizer_steps_per_cycle
            self._state = TrainerState(
                global_step=max((x.get("step", 0) for x in lines), default=0), max_steps=total,
                log_history=log_history(lines, reward_names(self.job.rewards), epochs))
            self._state.epoch = epochs.at(self._state.global_step)
        return self._state

    def _epochs(self) -> Epochs:
        from tandem.core.plan import BatchPlan

        plan = BatchPlan.from_config(self.job)
        return Epochs(plan.optimizer_steps_per_cycle, plan.unique_prompts, len(self.datasets["data"]))

    def trained_weights(self) -> str:
        """Where the run's trained adapter (or model) is: <output_dir>/adapter (or /model), else the newest
        checkpoint-N. A run that trained nothing yet is a JobConfigError."""
        out = Store(self.job.logging.output_dir)
        name, marker = ("adapter", "adapter_config.json") if self.job.model.lora else ("model", "config.json")
        if out.is_file(f"{name}/{marker}"):
            return join(self.job.logging.output_dir, name)
        if found := trl_checkpoints(self.job.logging.output_dir):
            return str(found[-1][1])
        raise JobConfigError(f"GRPOConfig.output_dir = {self.job.logging.output_dir!r}: no trained weights there "
                             "yet; call train() first")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """TRL's save_model: the trained adapter (PEFT format; the model where there is no LoRA) and the tokenizer
        files into output_dir (default: GRPOConfig.output_dir)."""
        save_weights(self.trained_weights(), self.job, output_dir or self.job.logging.output_dir)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
        """TRL's push_to_hub: what save_model writes, uploaded with huggingface_hub's upload_folder to
        GRPOConfig.hub_model_id (default: output_dir's name). Offline or without a token: one line naming what it
        needs."""
        return push_weights(self, commit_message, token, revision, blocking=blocking)

    @property
    def model(self):
        """The trained model (a PeftModel with the run's adapter; the model itself where there is no LoRA), loaded
        on the CPU when first asked for; before train(): the base model with a fresh adapter, as TRL's."""
        if self._model is None:
            self._model = load_trained(self)
        return self._model

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """TRL's evaluate: the run's evaluation of its final weights (Tandem evaluates on its rollout engines at the
        end of train() whenever an eval dataset is given), as TRL names it (`eval_reward`, ...)."""
        if eval_dataset is not None:
            raise JobConfigError("evaluate(eval_dataset=...): Tandem evaluates the eval_dataset given to GRPOTrainer, "
                                 "during train(); allowed: evaluate() with no dataset")
        if "eval" not in self.datasets and self.job.eval.path is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")  # TRL's own words
        rows = [r for r in self.state.log_history if any(k.startswith("eval_") for k in r)]
        if not rows:
            raise JobConfigError("evaluate(): the run has not evaluated yet; Tandem evaluates during train() (and at "
                                 "its end); call train() first")
        prefix = f"{metric_key_prefix}_"
        out = {prefix + k[5:] if k.startswith("eval_") else k: v for k, v in rows[-1].items()}
        self.state.log_history.append(out)  # as TRL's evaluate logs it
        from transformers import TrainerControl

        for event, kw in (("on_evaluate", {"metrics": out}), ("on_log", {"logs": out})):
            self.callbacks.fire(event, self.args, self.state, TrainerControl(), **kw)
        return {k: v for k, v in out.items() if k != "step"}

    def add_callback(self, callback: Any) -> None:
        self.callbacks.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callbacks.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callbacks.pop(callback)


# ------------------------------------------------------------------------------------------ helpers


def merged(base: dict, extra: dict) -> dict:
    """Sections merged one level deep (extra wins): a section given in two places keeps the fields of both."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def as_list(value: Any, arg: str) -> list:
    if value is None or (isinstance(value, (list, tuple)) and not value):
        raise JobConfigError(f"GRPOTrainer({arg}={value!r}): at least one is required (a function, a "
                             "module:function name, or a list of them)")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def model_and_lora(model: Any, peft_config: Any) -> tuple[str, dict | None]:
    """-> (model.path, the lora section): from a name, or a loaded model's name_or_path (a PeftModel's base and
    LoraConfig). No peft_config and no adapter on the model: full fine-tuning, as TRL."""
    adapter = None
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
    else:
        configs = getattr(model, "peft_config", None)
        if isinstance(configs, dict) and configs:  # a PeftModel: {adapter name: LoraConfig}
            adapter = configs.get(getattr(model, "active_adapter", None)) or next(iter(configs.values()))
            model = model.get_base_model()
        path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", "")
        if not path:
            raise JobConfigError(f"GRPOTrainer(model={type(model).__name__}): the model has no name_or_path; allowed: "
                                 "a Hub id or a local directory, or a model loaded from one (every node loads it by "
                                 "that name)")
    lora = peft_config if peft_config is not None else adapter
    return path, None if lora is None else lora_section(lora)


_LORA_NEUTRAL = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None,
                 "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True}


def _differs(value: Any, neutral: Any) -> bool:
    """A LoraConfig field away from its neutral value (an empty pattern dict or list counts as unset)."""
    return bool(value) if neutral in ({}, None) else value != neutral


def lora_section(lora: Any) -> dict:
    """A peft.LoraConfig as the lora section; what changes training and Tandem does not implement, refused."""
    if type(lora).__name__ != "LoraConfig":
        raise JobConfigError(f"GRPOTrainer(peft_config={type(lora).__name__}): allowed: a peft.LoraConfig")
    bad = [f"{k}={getattr(lora, k)!r}" for k, neutral in _LORA_NEUTRAL.items()
           if _differs(getattr(lora, k, neutral), neutral)]
    if bad:
        raise JobConfigError(f"GRPOTrainer(peft_config=LoraConfig(...)): not supported by Tandem: {', '.join(bad)}")
    targets = lora.target_modules
    if targets == "all-linear":  # peft's shorthand: the attention and MLP projections of a decoder
        targets = None
    elif isinstance(targets, str):
        raise JobConfigError(f"GRPOTrainer(peft_config=LoraConfig(target_modules={targets!r})): a regular expression; "
                             "allowed: a list of module names, or 'all-linear'")
    out = {"r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout}
    return out if targets is None else {**out, "target_modules": sorted(targets)}


def dataset_rows(ds: Any, arg: str) -> list[dict] | None:
    """A datasets.Dataset or a list of dicts -> rows; what Tandem cannot index (a stream, several splits) refused."""
    if ds is None:
        return None
    if isinstance(ds, list):
        if not all(isinstance(r, dict) for r in ds):
            raise JobConfigError(f"GRPOTrainer({arg}=[...]): every row must be a dict of columns")
        return ds
    if type(ds).__name__ in ("IterableDataset", "IterableDatasetDict"):
        raise JobConfigError(f"GRPOTrainer({arg}=IterableDataset): Tandem shuffles and resumes by row; allowed: a "
                             "datasets.Dataset (load_dataset without streaming=True) or a list of dicts")
    if isinstance(ds, dict) or type(ds).__name__ == "DatasetDict":
        raise JobConfigError(f"GRPOTrainer({arg}={type(ds).__name__} of {list(ds)}): one split; allowed: e.g. "
                             f"ds[{next(iter(ds), 'train')!r}]")
    if hasattr(ds, "to_list"):
        return ds.to_list()
    raise JobConfigError(f"GRPOTrainer({arg}={type(ds).__name__}): allowed: a datasets.Dataset or a list of dicts")


def check_tokenizer(tokenizer: Any, cfg: JobConfig) -> None:
    """Every node reads the tokenizer saved with the model: one given here must be that one (its chat template
    included: an Unsloth notebook's get_chat_template changes it in memory only)."""
    if tokenizer is None:
        return
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(cfg.model.local_dir())
    mine = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    if getattr(mine, "chat_template", None) != saved.chat_template or len(mine) != len(saved):
        raise JobConfigError(
            f"GRPOTrainer(processing_class=...): differs from the tokenizer saved with model {cfg.model.path!r} "
            "(its chat template or vocabulary), which every node reads; allowed: that tokenizer, or None; to use "
            "yours, save the model and it to a directory (save_pretrained) and pass that directory")


def user_modules(fns: dict[str, Any]) -> list:
    """The modules of the user's own functions (not installed libraries, not Tandem): pickled by value, so a
    worker needs none of them importable (a script's __main__ and a notebook's cells are by value already)."""
    lib = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    out = []
    for fn in fns.values():
        mod = sys.modules.get(getattr(fn, "__module__", "") or "")
        f = getattr(mod, "__file__", None)
        if mod is None or f is None or mod.__name__ == "__main__" or mod.__name__.startswith("tandem"):
            continue
        if not any(str(Path(f).resolve()).startswith(str(Path(p).resolve())) for p in lib):
            out.append(mod)
    return out


def pickled(fns: dict[str, Any]) -> bytes:
    """{name: function} pickled by value (cloudpickle), the user's own modules included."""
    import cloudpickle

    mods = user_modules(fns)
    for m in mods:
        cloudpickle.register_pickle_by_value(m)
    try:
        return cloudpickle.dumps(fns)
    finally:
        for m in mods:
            cloudpickle.unregister_pickle_by_value(m)


def write_functions(output_dir: str, fns: dict[str, Any]) -> None:
    """{name: function} pickled by value into the run directory (a local path or a storage URI), whole or not at
    all."""
    Store(output_dir).write_bytes(FUNCTIONS_FILE, pickled(fns))


def train_output(metrics: Path, cfg: JobConfig, runtime_s: float, epochs: Epochs) -> TrainOutput:
    """TRL's TrainOutput of the run: the mean loss over its steps, the rates over this call's wall time."""
    from tandem.core.plan import BatchPlan

    lines = read_lines(metrics)
    steps = [x for x in lines if "loss" in x]
    loss = sum(x["loss"] for x in steps) / len(steps) if steps else float("nan")
    step = max((x.get("step", 0) for x in lines), default=0)
    samples = len(steps) * BatchPlan.from_config(cfg).effective_batch_size
    rt = max(runtime_s, 1e-9)
    return TrainOutput(step, loss, {"train_runtime": round(runtime_s, 4), "train_samples_per_second": round(samples / rt, 3),
                                    "train_steps_per_second": round(len(steps) / rt, 3), "total_flos": 0.0,
                                    "train_loss": loss, "epoch": epochs.at(step)})


def check_resume_target(given: bool | str, cfg: JobConfig) -> None:
    """train(resume_from_checkpoint=...): True, or the run's newest checkpoint, as TRL's `checkpoint-N` or Tandem's
    `checkpoints/cycle-N`. An older one is refused, naming the newest: resuming from it would train over the steps
    after it (Tandem resumes its newest complete checkpoint)."""
    from tandem.services.orchestrator.checkpointer import complete_checkpoints

    if given is True:
        return
    path = str(given).rstrip("/") if is_uri(str(given)) else str(Path(given).resolve())
    complete = complete_checkpoints(cfg.checkpoint_dir)
    newest = (complete or [None])[-1]
    trl = [(p, tandem_checkpoint(str(p), cfg.checkpoint_dir)) for _, p in trl_checkpoints(cfg.logging.output_dir)]
    named = lambda c: next((str(p) for p, t in trl if t is not None and t.name == c.name), str(c))  # noqa: E731
    if not Store(path).exists():
        raise JobConfigError(f"train(resume_from_checkpoint={given!r}): no such checkpoint; the run's newest is "
                             f"{named(newest) if newest else 'none (nothing saved yet)'}; allowed: True, or the newest")
    target = tandem_checkpoint(path, cfg.checkpoint_dir) if Store(path).is_file("trainer_state.json") else Location(path)
    runs = [str(Location(x) if is_uri(str(x)) else Path(x).resolve()) for x in (cfg.logging.output_dir,
                                                                               cfg.checkpoint_dir)]
    if target is None or not any(path == r or path.startswith(r.rstrip("/") + "/") for r in runs):
        raise JobConfigError(f"train(resume_from_checkpoint={given!r}): not a checkpoint of this run; allowed: True, "
                             f"or {cfg.logging.output_dir}/checkpoint-N")
    if not any(Location(target).name == c.name for c in complete):
        raise JobConfigError(f"train(resume_from_checkpoint={given!r}): an incomplete or damaged checkpoint (its "
                             f"{Location(target).name} has no tandem.json); the run's newest complete one is "
                             f"{named(newest) if newest else 'none'}; allowed: True, or that one")
    if Location(target).name != newest.name:
        raise JobConfigError(f"train(resume_from_checkpoint={given!r}): not the run's newest checkpoint "
                             f"({named(newest)}); resuming from it would train over the steps after it; "
                             "allowed: True, or the newest")


def save_weights(src: str, cfg: JobConfig, output_dir: str) -> None:
    """save_model's files: those of the adapter (or model) directory `src` and the tokenizer's, into output_dir."""
    weights, out = Store(src), Store(output_dir)
    for f in weights.files():
        if f not in ("trainer_state.json", POINTER):
            out.write_bytes(f, weights.read_bytes(f))
    write_tokenizer_files(cfg, out)


def push_weights(trainer: GRPOTrainer, commit_message: str | None, token: str | None, revision: str | None,
                 blocking: bool = True) -> Any:
    """push_to_hub: save_model's files in a temporary directory, uploaded by huggingface_hub."""
    import tempfile

    from huggingface_hub import HfApi, get_token
    from huggingface_hub.constants import is_offline_mode

    if is_offline_mode():
        raise JobConfigError("push_to_hub(): the Hugging Face Hub is offline here (HF_HUB_OFFLINE=1); allowed: a "
                             "machine that reaches the Hub with HF_HUB_OFFLINE unset, or save_model(dir) and upload "
                             "that directory later")
    token = token or trainer.args.hub_token or get_token()
    if not token:
        raise JobConfigError("push_to_hub(): no Hugging Face token; allowed: `hf auth login`, HF_TOKEN, "
                             "GRPOConfig(hub_token=...), or push_to_hub(token=...)")
    repo = trainer.args.hub_model_id or Path(str(trainer.job.logging.output_dir)).name
    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo, private=trainer.args.hub_private_repo, exist_ok=True).repo_id
    except Exception as e:  # noqa: BLE001 - only the network's errors are said here; others go on as they are
        if not unreachable(e):
            raise
        raise TandemError(f"push_to_hub(): the Hugging Face Hub ({api.endpoint}) cannot be reached for repo {repo!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); nothing was uploaded; "
                          "allowed: a machine that reaches the Hub, or save_model(dir) and upload that directory "
                          "later") from e
    folder = tempfile.mkdtemp(prefix="tandem-push-")  # left for a background upload (blocking=False) to read
    trainer.save_model(folder)
    result = api.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message or "End of training",
                               revision=revision or trainer.args.hub_revision, run_as_future=not blocking)
    if blocking:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def unreachable(e: BaseException) -> bool:
    """A network error on the way to a server (refused, no route, no name, timed out), as httpx or requests raise it."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TransportError", "ConnectionError", "Timeout"}) or \
        isinstance(e, (ConnectionError, TimeoutError))


def load_trained(trainer: GRPOTrainer):
    """The trained model on the CPU: the base with the run's adapter (peft), or the trained model itself."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = trainer.job
    dtype = getattr(torch, cfg.model.dtype) if cfg.model.dtype not in (None, "auto") else "auto"
    try:
        weights = trainer.trained_weights()
    except JobConfigError:
        weights = None
    if weights is not None and is_uri(weights):  # read from a local copy
        import tempfile

        local = Path(tempfile.mkdtemp(prefix="tandem-weights-"))
        Store(weights).download("", local)
        weights = str(local)
    if cfg.model.lora is None:
        return AutoModelForCausalLM.from_pretrained(weights or cfg.model.local_dir(), dtype=dtype)
    base = AutoModelForCausalLM.from_pretrained(cfg.model.local_dir(), dtype=dtype)
    if weights is None:
        from tandem.core.adapter import with_lora

        return with_lora(base, cfg.model.lora, cfg.model.path)
    from peft import PeftModel

    return PeftModel.from_pretrained(base, weights)
