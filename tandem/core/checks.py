"""What a valid job needs of the machine it runs on: files that exist, reward functions that import,
CUDA for float16. Run in the process that uses each (the controller reads the data, the rollout
worker imports the rewards, the learner needs CUDA), and all at once by `tandem run` on this
machine and by `tandem check`. Each failure is a JobConfigError naming the field and the value."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tandem.core.config import JobConfig, JobConfigError
from tandem.core.hub import is_hub_id
from tandem.core.loader import load_function
from tandem.core.storage import Location, Store, check_reachable, is_uri

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def model_error(cfg: JobConfig) -> str | None:
    v = cfg.model.path
    try:
        local = cfg.model.local_dir()  # a Hub id: its snapshot in this node's cache, or why not
    except JobConfigError as e:
        return str(e)
    if not (Path(local) / "config.json").is_file():
        return f"model.path = {v!r}: no config.json there; give a local model directory or a Hub model id"
    return None


def language_model_config(model_path: str) -> dict | None:
    """The model's config.json as a dict, the language model's part of a multimodal one; None when it cannot
    be read (model_error names a missing config; an unreadable one fails where transformers reads it)."""
    import json

    try:
        mc = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return mc.get("text_config", mc) if isinstance(mc, dict) else None


def length_error(cfg: JobConfig) -> str | None:
    """A prompt and its completion must fit the model's positions (else vLLM refuses every request late,
    naming its own max_model_len)."""
    try:
        mc = language_model_config(cfg.model.local_dir())
    except JobConfigError:
        return None  # model_error names it
    if mc is None:
        return None
    limit = mc.get("max_position_embeddings")
    g = cfg.generation
    if isinstance(limit, int) and g.max_prompt_length + g.max_completion_length > limit:
        return (f"generation.max_prompt_length + generation.max_completion_length = {g.max_prompt_length} + "
                f"{g.max_completion_length} = {g.max_prompt_length + g.max_completion_length}: longer than the "
                f"model's {limit} positions (max_position_embeddings in {cfg.model.path}/config.json); allowed: "
                f"a sum <= {limit}")
    return None


def data_error(cfg: JobConfig, field: str = "data.path") -> str | None:
    """The prompt file at `field` (data.path, eval.path)."""
    section, name = field.split(".")
    v = getattr(getattr(cfg, section), name)
    if v is None:
        return None
    p = Path(v)
    if is_hub_id(v):  # no local path of that name
        return None  # a Hub dataset: read (or refused, naming it and the cache) where the data is read
    if not p.exists():
        return f"{field} = {v!r}: no such file or directory, nor a Hub dataset id"
    if p.is_file() and p.suffix not in DATA_SUFFIXES:
        return f"{field} = {v!r}: file type {p.suffix!r} not supported; allowed {' '.join(DATA_SUFFIXES)}"
    return None


def map_error(cfg: JobConfig) -> str | None:
    if cfg.data.map is None:
        return None
    try:
        load_function(cfg.data.map)
    except ValueError as e:
        return f"data.map = {cfg.data.map!r}: {e}"
    return None


TRACKER_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                  "mlflow": ("mlflow", "mlflow")}  # report_to name -> (module, tandem extra)


def tracker_errors(cfg: JobConfig) -> list[str]:
    """Each tracker in logging.report_to needs its package (an optional extra)."""
    out = []
    for name in cfg.logging.report_to:
        module, extra = TRACKER_EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            out.append(f"logging.report_to = {name!r}: the {module!r} package is not installed; "
                       f"pip install 'tandem[{extra}]' (or remove {name!r} from report_to)")
    return out


def reward_errors(cfg: JobConfig) -> list[str]:
    out = []
    for i, spec in enumerate(cfg.rewards):
        try:
            load_function(spec)
        except Exception as e:  # noqa: BLE001 - the message is the point
            out.append(f"rewards[{i}] = {spec!r}: {e}")
    return out


def tool_errors(cfg: JobConfig) -> list[str]:
    """Each tool imports, has a JSON schema (type hints and a docstring, as TRL's tools= needs) and a name of its
    own (the model calls a tool by its function's name)."""
    if not cfg.tools:
        return []  # transformers (and torch with it) stays out of a controller that only tokenises
    from transformers.utils import get_json_schema

    out, names = [], {}
    for i, spec in enumerate(cfg.tools or []):
        try:
            fn = load_function(spec)
            get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - the message is the point
            out.append(f"tools[{i}] = {spec!r}: {e}")
            continue
        if fn.__name__ in names:
            out.append(f"tools[{i}] = {spec!r}: a tool named {fn.__name__!r} is already tools[{names[fn.__name__]}]; "
                       "the model calls tools by name, so each needs its own")
        names.setdefault(fn.__name__, i)
    return out


def load_environment(spec: str) -> tuple[type, list[str]]:
    """`environment: module:Class` -> (the class, its tool methods' names), checked: a reset method, and a JSON schema
    (type hints and a docstring) for each public method but reset and get_reward (TRL's environment_factory)."""
    import inspect

    from transformers.utils import get_json_schema

    env_cls = load_function(spec)
    if not callable(getattr(env_cls, "reset", None)):
        raise ValueError(f"environment = {spec}: needs a reset(**row) method (TRL's environment_factory shape)")
    try:
        inspect.signature(env_cls).bind()
    except TypeError as e:
        raise ValueError(f"environment = {spec}: its constructor cannot be called without arguments ({e}); Tandem "
                         "makes one instance per episode with none, as TRL's environment_factory does; allowed: "
                         "defaults for every argument, the row's values read in reset(**row)") from None
    except ValueError:  # a signature inspect cannot read (a builtin base): made as it is
        pass
    names = sorted(n for n, _ in inspect.getmembers(env_cls, inspect.isfunction)
                   if n not in ("reset", "get_reward") and not n.startswith("_"))
    for name in names:
        try:
            get_json_schema(getattr(env_cls, name))
        except Exception as e:  # noqa: BLE001 - the message is the point
            raise ValueError(f"environment = {spec}: tool method {name!r}: {e}") from None
    return env_cls, names


def environment_errors(cfg: JobConfig) -> list[str]:
    """The environment class as load_environment checks it, and no tool method named as a function of tools."""
    if cfg.environment is None:
        return []
    try:
        _, names = load_environment(cfg.environment)
    except Exception as e:  # noqa: BLE001 - the message is the point
        return [str(e) if str(e).startswith("environment = ") else f"environment = {cfg.environment!r}: {e}"]
    tools = {load_function(t).__name__ for t in cfg.tools or []}
    return [f"environment = {cfg.environment!r}: its method {n!r} has the name of a function in tools; the model "
            "calls tools by name, so each needs its own" for n in names if n in tools]


def lora_target_error(cfg: JobConfig) -> str | None:
    """model.lora.target_modules against the model: the learner's and the engines' own refusal
    (tandem.core.adapter.with_lora), on the model built from its config on the meta device (no weights read).
    Imports torch and transformers: `tandem check`'s, not the controller's."""
    if cfg.model.lora is None or model_error(cfg) is not None:
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.core.adapter import with_lora

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.local_dir()))
    except Exception:  # noqa: BLE001 - a model transformers cannot build here is refused where it is loaded
        return None
    try:
        with_lora(model, cfg.model.lora, cfg.model.path)
    except JobConfigError as e:
        return str(e)
    return None


def device_error(cfg: JobConfig) -> str | None:
    """float16 trains only with CUDA (DeepSpeed's loss scaling); asked where the learner runs."""
    if cfg.model.dtype != "float16":
        return None
    if importlib.util.find_spec("torch") is not None:
        import torch  # only reached when someone asks for float16

        if torch.cuda.is_available():
            return None
    return "model.dtype = 'float16': needs CUDA (DeepSpeed refuses fp16 on CPU); use 'bfloat16' or 'float32'"


def this_machine_errors(cfg: JobConfig) -> list[str]:
    """Why `tandem run` on this machine (an embedded Ray of one node) would refuse the job, where a cluster might not:
    a dtype this machine cannot train in, a role's resources it does not have."""
    import os

    gpus = 0
    if importlib.util.find_spec("torch") is not None:
        import torch

        gpus = torch.cuda.device_count()
    node = {"Alive": True, "Resources": {"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}}
    return [e for e in [device_error(cfg), *resource_errors(cfg, [node])] if e]


def resource_errors(cfg: JobConfig, nodes: list[dict]) -> list[str]:
    """Each role's per-actor request against the nodes Ray lists (`ray.nodes()`: "Alive", "Resources"):
    one that no live node could ever hold, named with what the nodes have. Without this the actor waits
    for a node forever, and the job with it."""
    have = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    c = cfg.cluster
    roles = {f: _request(getattr(c, f)) for f in ("rollout_resources", "learner_resources")}
    if c.vllm_mode == "colocate":
        roles["rollout_resources + learner_resources (vllm_mode colocate: one actor)"] = colocated_request(cfg)
    out = []
    for field, need in roles.items():
        if any(all(h.get(k, 0.0) >= v for k, v in need.items()) for h in have):
            continue
        largest = {k: max((h.get(k, 0.0) for h in have), default=0.0) for k in need}
        out.append(f"cluster.{field} = {need}: no node of the Ray cluster has that much (the most any node has: "
                   f"{largest}); allowed: what one node has, e.g. num_gpus: 0 on a machine without a GPU")
    return out


def _request(r) -> dict[str, float]:
    need = {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.resources}
    return {k: v for k, v in need.items() if v > 0}


def colocated_request(cfg: JobConfig) -> dict[str, float]:
    """What the colocated actor (rollout worker 0 + the learner, vllm_mode colocate) asks Ray for: both."""
    both = _request(cfg.cluster.rollout_resources)
    for k, v in _request(cfg.cluster.learner_resources).items():
        both[k] = both.get(k, 0.0) + v
    return both


def shared_gpu_error(cfg: JobConfig, placements: list[dict]) -> str | None:
    """Learner ranks Ray put on the same GPU of one node (it fills a GPU with fractional requests before
    the next): NCCL needs a GPU per rank. placements: [{"rank", "node", "gpus"}]."""
    owner: dict = {}
    for p in placements:
        for g in p["gpus"]:
            other = owner.setdefault((p["node"], g), p["rank"])
            if other != p["rank"]:
                n = cfg.cluster.learner_resources.num_gpus
                return (f"cluster.learner_resources.num_gpus = {n} with cluster.num_processes = "
                        f"{cfg.cluster.num_processes}: Ray placed learner ranks {other} and {p['rank']} on the same "
                        f"GPU ({g}) of one node, and NCCL needs one GPU per rank; allowed: num_gpus above 0.5 per "
                        "rank (the learner's share of each GPU; the rollout workers take the rest), or 1")
    return None


def raise_if(errors: list[str | None]) -> None:
    found = [e for e in errors if e]
    if found:
        raise JobConfigError("invalid job: " + "; ".join(found))


def run_dir_in_use(cfg: JobConfig) -> str | None:
    """What shows that output_dir holds an earlier run (its metrics or a complete checkpoint), or None."""
    out = Location(cfg.logging.output_dir)
    if Store(out).is_file("metrics.jsonl"):
        return str(out / "metrics.jsonl")
    ck = Store(cfg.checkpoint_dir)
    done = [name for name, is_dir in ck.children() if is_dir and ck.is_file(f"{name}/tandem.json")]
    return str(Location(cfg.checkpoint_dir) / done[-1]) if done else None


def unwritable(output_dir: str, field: str = "logging.output_dir") -> str | None:
    """Why the run directory cannot be written or made (a read-only mount, no permission; a storage URI this node
    has no credentials or endpoint for), or None. Tried with a temporary file in it, or in its nearest existing
    parent when it is still to be made: nothing is left behind."""
    import tempfile

    if is_uri(output_dir):
        return check_reachable(output_dir, field)
    out = Path(output_dir).absolute()
    if out.exists() and not out.is_dir():
        return f"{field} = {str(out)!r}: a file, not a directory"
    here = next(p for p in (out, *out.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        return (f"{field} = {output_dir!r}: cannot write {'there' if here == out else f'in {str(here)!r}'} "
                f"({type(e).__name__}: {e.strerror or e}); allowed: a directory this user can create and write")
    return None


def run_dir_error(cfg: JobConfig) -> str | None:
    """A fresh run never mixes with an earlier one: it resumes it or is told to overwrite it."""
    out = cfg.logging.output_dir
    if why := unwritable(out):
        return why
    if cfg.model.lora is None and not is_uri(out) and Path(cfg.model.path).resolve() == (Path(out) / "model").resolve():
        return (f"model.path = {cfg.model.path!r}: is <output_dir>/model, where a full fine-tuning run writes its "
                "trained model (it would replace the model it starts from); allowed: the model elsewhere, or another "
                "logging.output_dir")
    if earlier_run(cfg) == "refuse":
        return (f"logging.output_dir = {out!r}: holds an earlier run ({run_dir_in_use(cfg)}); allowed: "
                "checkpoint.resume: true to continue it, logging.overwrite_output_dir: true to start over there, "
                "or another directory")
    return None


def earlier_run(cfg: JobConfig) -> str | None:
    """What `tandem run` does with an earlier run in output_dir: "resume", "overwrite", "refuse"; None: there is none."""
    if not run_dir_in_use(cfg):
        return None
    return "resume" if cfg.checkpoint.resume else "overwrite" if cfg.logging.overwrite_output_dir else "refuse"


def check_inputs(cfg: JobConfig, given: set[str] = frozenset(), *, run_dir: bool = True) -> None:
    """Model, data and reward functions as this machine sees them, and (run_dir) a run directory of its own. given:
    the sections ("data", "eval") whose rows came from Python instead of a path."""
    data = [data_error(cfg, f"{sec}.path") for sec in ("data", "eval") if sec not in given]
    raise_if([model_error(cfg), length_error(cfg), *data, *reward_errors(cfg), map_error(cfg),
              *tool_errors(cfg), *environment_errors(cfg), *tracker_errors(cfg),
              run_dir_error(cfg) if run_dir else unwritable(cfg.logging.output_dir)])


def check_learner_device(cfg: JobConfig) -> None:
    raise_if([device_error(cfg)])


def write_shared_probe(output_dir: str) -> str:
    """A file under output_dir that every learner rank must read back: checkpoints are written by the
    learner and read by the controller, so the run directory must be one filesystem seen from every
    node at the same path, or a storage URI every node reaches. -> its path."""
    import uuid

    if not is_uri(output_dir):
        output_dir = str(Path(output_dir).resolve())
    name = f".tandem-probe-{uuid.uuid4().hex[:12]}"
    Store(output_dir).write_bytes(name, name.encode())
    return str(Location(output_dir) / name)


def check_shared_dir(output_dir: str, probe: str | None, who: str) -> None:
    if probe is None:
        return
    name = Location(probe).name
    try:
        store = Store(probe)
        seen = store.read_bytes("") if store.is_file("") else b""
    except OSError as e:
        seen = str(e).encode()
    if seen != name.encode():
        how = (f"cannot read {probe}, which the controller wrote there (this node's storage credentials or endpoint: "
               f"{seen.decode()[:200] or 'not found'})" if is_uri(probe) else f"cannot read {probe}, which the "
               "controller wrote there")
        raise JobConfigError(
            f"logging.output_dir = {output_dir!r}: {who} on node {this_node()} {how}; allowed: a storage URI every "
            "node reaches (s3://bucket/run, gs://...), or a directory on a filesystem every node mounts at the same "
            "path (NFS, a shared volume)")


def this_node() -> str:
    """This process's node as a user can find it: the host, its IP and Ray's node id (several nodes of one machine
    share a host and an IP)."""
    import socket

    import ray

    return (f"{socket.gethostname()} ({ray.util.get_node_ip_address()}, Ray node "
            f"{ray.get_runtime_context().get_node_id()[:12]})")


def raise_on_node(who: str, errors: list[str | None]) -> None:
    """What an actor cannot read on its own node, in one line naming the actor and the node: the driver checked the
    same paths on its node, so a miss here is a node that does not see the job's files."""
    found = [e for e in errors if e]
    if found:
        raise JobConfigError(f"invalid job on {who}, node {this_node()}: " + "; ".join(found) + " (each node reads "
                             "the job's files at these paths: a filesystem every node mounts, or `tandem submit`, "
                             "which ships them with the job)")
