"""`from tandem import GRPOTrainer, GRPOConfig`: TRL's constructor and `.train()`, running the job `tandem run` runs.

A TRL or Unsloth script changes its import and runs on Ray: the arguments become a JobConfig (TRL's names through
`JobConfig.from_trl`, Tandem's own sections as dicts), functions made in the user's process (reward functions, tools,
an environment class; closures and notebook cells included) are pickled by value into the run directory, which every
node already sees (checkpoints need it), and the datasets go to the controller through Ray's object store, once.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from tandem.core.config import JobConfig, JobConfigError, with_absolute_paths
from tandem.core.storage import Store, is_uri, join
from tandem.core.trl import trl_to_sections

# Tandem's sections a GRPOConfig takes as dicts (what TRL has no name for: workers, staleness, resources, ...)
SECTIONS = ("model", "data", "generation", "batch", "grpo", "optimizer", "cluster", "checkpoint", "logging", "eval")
TOP_LEVEL = ("reward_timeout_s", "tool_timeout_s")
FUNCTIONS_FILE = ".tandem/functions.pkl"  # in the run directory
# GRPOTrainer arguments of TRL that Tandem does not take, refused by name when given
REFUSED = {
    "reward_processing_classes": "reward models are not supported (reward functions are)",
    "callbacks": "transformers callbacks run inside TRL's Trainer loop; Tandem reports to logging.report_to "
                 "trackers and <output_dir>/metrics.jsonl",
    "optimizers": "Tandem's learner builds its AdamW and schedule from the optimizer section",
    "quantization_config": "quantized training (QLoRA) is not supported",
    "rollout_func": "custom rollout functions are not supported; tools= and environment_factory= are",
}


class TrainOutput(NamedTuple):
    """What transformers' Trainer.train returns: the last step, the mean training loss, the last metrics line."""
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

    @classmethod
    def from_any(cls, args: Any, default_output_dir: str) -> GRPOConfig:
        """A tandem.GRPOConfig, a trl.GRPOConfig (the fields it sets away from TRL's defaults), a dict, or None."""
        if args is None:
            return cls(default_output_dir)
        if isinstance(args, cls):
            return args if args.output_dir is not None else cls(default_output_dir, **args.trl, **args.sections)
        if isinstance(args, dict):
            return cls(**{"output_dir": default_output_dir, **args})
        if dataclasses.is_dataclass(args) and hasattr(args, "num_generations"):  # trl.GRPOConfig
            return cls(**changed_fields(args))
        raise JobConfigError(f"GRPOTrainer(args={type(args).__name__}): allowed: tandem.GRPOConfig, trl.GRPOConfig, "
                             "a dict of their names, or None")


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
                 environment_factory: Any = None, address: str | None = None, **trl_only: Any):
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

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """resume_from_checkpoint (TRL's argument): True, or a checkpoint of this run, continues from the run's
        newest complete checkpoint (Tandem resumes the newest it can read, naming any it skips)."""
        from tandem.core.checks import check_inputs
        from tandem.services.app.run import hold_run_dirs, run_job, start_ray

        cfg = self.job
        if resume_from_checkpoint:
            ck = cfg.checkpoint_dir if is_uri(cfg.checkpoint_dir) else str(Path(cfg.checkpoint_dir).resolve())
            given = str(resume_from_checkpoint)
            given = given.rstrip("/") if is_uri(given) else str(Path(given).resolve())
            if resume_from_checkpoint is not True and not (given == ck or given.startswith(ck.rstrip("/") + "/")):
                raise JobConfigError(f"train(resume_from_checkpoint={resume_from_checkpoint!r}): not a checkpoint of "
                                     f"this run; allowed: True, or a path under {ck}")
            cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": True})})
        with hold_run_dirs(cfg):
            if self.functions:
                write_functions(cfg.logging.output_dir, self.functions)
            check_inputs(cfg, given=set(self.datasets))
            ray = start_ray(self.address or cfg.cluster.address, cfg)
            refs = {k: ray.put(v) for k, v in self.datasets.items()}  # the controller reads them once
            rc = run_job(cfg, address=self.address or cfg.cluster.address, datasets=refs)
        if rc == 130:
            raise KeyboardInterrupt("tandem: training interrupted (a checkpoint was saved)")
        return train_output(Path(cfg.run_dir) / "metrics.jsonl")


# ------------------------------------------------------------------------------------------ helpers


def merged(base: dict, extra: dict) -> dict:
    """Sections merged one level deep (extra wins): a section given in two places keeps the fields of both."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def as_list(value: Any, arg: str) -> list:
    if value is None:
        raise JobConfigError(f"GRPOTrainer({arg}=None): at least one is required")
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


def train_output(metrics: Path) -> TrainOutput:
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    steps = [x for x in lines if "loss" in x]
    loss = sum(x["loss"] for x in steps) / len(steps) if steps else float("nan")
    return TrainOutput(max((x.get("step", 0) for x in lines), default=0), loss, lines[-1] if lines else {})
