"""Learner: `num_processes` Ray actors, one torch.distributed group under DeepSpeed.

Every rank receives the whole generation batch (refs into the object store), computes the
advantages on all of it, and trains on its own rows of each micro-step per the batch plan.
Knowing every rank's rows also gives the dapo token count of each optimizer step without a
collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch

from tandem.core.checks import check_learner_device, check_shared_dir, model_error, raise_on_node
from tandem.core.compat import before_deepspeed_init, set_distributed_env
from tandem.core.engine_memory import token_lag_bound
from tandem.core.plan import BatchPlan
from tandem.kernels.logprobs import TisFromLogp
from tandem.learner import checkpoint_io
from tandem.learner.batch import Samples, attention_pairs, collate, loss_mask, real_tokens, to_device
from tandem.learner.forwards import plan_weights, token_budget_bins
from tandem.learner.grpo import (
    LossInputs,
    compute_advantages,
    grpo_loss,
    grpo_metrics,
    tis_weight,
    token_term_params,
    with_overlong_column,
)
from tandem.learner.layout import Launch, Layout, decide_layout, step_flops, training_flops
from tandem.learner.logprobs import completion_grpo_loss, completion_logprobs
from tandem.learner.metrics import (
    accumulate,
    memory_peaks,
    outside_allocator_gib,
    reduce_metrics,
    rollout_stats,
    train_phases,
)
from tandem.learner.model import (
    copy_to_cpu,
    load_frozen_reference,
    load_policy,
    reference_context,
    trainable_state_dict,
)
from tandem.learner.non_finite import describe, non_finite_input
from tandem.learner.overflow import check_in_one_readback
from tandem.learner.process_group import join_process_group, open_store
from tandem.learner.safe_load import refuse_pickles
from tandem.learner.shared_weights import learner_device, share_engine_weights


def _check_token_ids(groups, vocab: int):
    """An id outside the model's vocabulary would index past the embedding (on CUDA a device-side
    assert, which takes the whole process down): name the group and the id instead."""
    for g in groups:
        for name, ids in (("prompt_ids", g.prompt_ids), ("tokens", g.tokens)):
            lo, hi = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"Learner.train: group {g.group_id} {name} holds token id {bad}; the model's "
                                 f"vocabulary is 0..{vocab - 1}")


def lr_lambda(kind: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup  # first step already at lr/warmup, as HF's schedulers do
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(total - warmup, 1)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return f


def ds_config(cfg, world: int) -> dict:
    b, o = cfg.batch, cfg.optimizer
    c = {
        "train_micro_batch_size_per_gpu": b.per_device_train_batch_size,
        "gradient_accumulation_steps": b.gradient_accumulation_steps,
        "train_batch_size": b.per_device_train_batch_size * b.gradient_accumulation_steps * world,
        "zero_optimization": {"stage": cfg.cluster.zero_stage},
        "gradient_clipping": o.max_grad_norm,
        "optimizer": {"type": "AdamW", "params": {
            "lr": o.learning_rate, "betas": [o.adam_beta1, o.adam_beta2], "eps": o.adam_epsilon,
            "weight_decay": o.weight_decay, "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16":
        c["bf16"] = {"enabled": True}
    elif cfg.model.dtype == "float16":
        c["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return c


class Learner:
    """Lifecycle (torchtune's): `Learner(...)` stores its arguments; `setup()` joins the process group and
    builds the DeepSpeed engine; then `train` per cycle, `export_adapter`, `save_checkpoint` /
    `load_checkpoint`; the actor is killed at the end (no cleanup beyond the process)."""

    def __init__(self, cfg, rank: int = 0, world: int = 1, total_steps: int = 1000, optimizer=None,
                 probe: str | None = None):
        """`optimizer`: optional callable(params) -> torch optimizer replacing AdamW (tests use SGD,
        whose update shows any gradient scaling that Adam's normalisation would hide). `probe`: a file the
        controller wrote under output_dir; setup() refuses to start if this rank cannot read it."""
        self.cfg, self.rank, self.world = cfg, rank, world
        self.launch = Launch(total_steps, optimizer, probe)
        self.store = None  # rank 0's rendezvous store, from rendezvous() to setup()
        self.plan = BatchPlan.from_config(cfg)
        self.version = 0
        self.steps = 0
        self.layout: Layout | None = None  # decided by setup()

    @property
    def tis(self) -> bool:
        return self.cfg.tis

    @property
    def token_budget(self) -> int | None:
        return self.layout.token_budget

    def placement(self) -> dict:
        """Where Ray put this rank (before setup): its node (Ray's id, host name, address) and the GPU ids it was
        given."""
        import socket

        import ray

        return {"rank": self.rank, "node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0, before any rank's setup(): opens the group's store on this node. -> (this node's address, the
        store's port), which every rank's setup() takes."""
        import ray

        self.store = open_store(self.world)
        return ray.util.get_node_ip_address(), self.store.port

    def setup(self, address: tuple[str, int] | None = None, engine_weights: tuple[dict, dict] | None = None) -> int:
        """`address`: rank 0's rendezvous(); None for a group of one rank. `engine_weights`: a colocated engine's
        (parameters, packed layers), which the frozen base reads where equal (learner/shared_weights.py)."""
        cfg = self.cfg
        raise_on_node(f"learner rank {self.rank}", [model_error(cfg)])
        check_learner_device(cfg)
        launch = self.launch
        check_shared_dir(cfg.logging.output_dir, launch.probe, f"learner rank {self.rank}")
        held_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0  # a colocated engine's
        set_distributed_env(self.rank, self.world)
        before_deepspeed_init()
        import deepspeed

        join_process_group(self.rank, self.world, address, self.store)
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
        outside_group = outside_allocator_gib(learner_device())  # the CUDA context and process group, before the model
        torch.manual_seed(cfg.seed)
        model = load_policy(cfg)
        shared = 0
        if engine_weights and cfg.cluster.zero_stage != 3:  # ZeRO-3 would partition them away
            shared = share_engine_weights(model, *engine_weights, learner_device())
        if shared:
            print(f"learner: {shared / 2**20:.1f} MiB of its frozen weights are the colocated engine's (views, not "
                  "copies)", flush=True)
        params = [p for p in model.parameters() if p.requires_grad]
        o = cfg.optimizer
        warm = o.warmup_steps or math.ceil(o.warmup_ratio * launch.total_steps)
        dsc = ds_config(cfg, self.world)
        client_opt = None
        if launch.optimizer is not None:
            dsc.pop("optimizer")
            dsc["zero_allow_untested_optimizer"] = True
            client_opt = launch.optimizer(params)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=params, config=dsc, optimizer=client_opt,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lr_lambda(o.lr_scheduler_type, warm, launch.total_steps)),
        )
        refuse_pickles(self.engine)
        check_in_one_readback(self.engine)  # DeepSpeed's per-gradient readbacks at the step (learner/overflow.py)
        self.device = self.engine.device  # batches are collated on the host and moved here
        self.ref = load_frozen_reference(cfg).to(self.device) if (cfg.grpo.beta > 0 and cfg.model.lora is None) else None
        self.layout = decide_layout(cfg, model, self.device, held_before, shared)  # once this rank's tensors are placed
        outside_engine = outside_allocator_gib(self.device)
        if outside_group is not None and outside_engine is not None:
            print(f"learner rank {self.rank}: beyond torch's allocator on its GPU {outside_group:.2f} GiB with the "
                  f"process group, {outside_engine:.2f} GiB with DeepSpeed's engine", flush=True)
        return self.rank

    # ----------------------------------------------------------------------------- helpers

    @property
    def model(self):
        return self.engine.module

    def needs_old(self) -> bool:
        """Old log-probs need a forward of their own only where the weights move within a cycle (several
        optimizer steps per generation batch). With one, every training pass runs on the cycle's starting
        weights, so its own log-probs are the old ones, and TIS takes its weight from them: one decoder
        forward per micro-step fewer (TRL runs that forward whenever TIS is on)."""
        return self.plan.optimizer_steps_per_cycle > 1

    def _logp(self, mb, with_entropy=False, reference=False):
        T = self.cfg.generation.temperature
        # the loss and its metrics read the masked tokens only: no lm_head pass over the rest
        if reference and self.ref is not None:
            return completion_logprobs(self.ref, mb, T, masked=True)[0]
        if reference:
            with reference_context(self.model):
                return completion_logprobs(self.model, mb, T, masked=True)[0]
        return completion_logprobs(self.model, mb, T, with_entropy=with_entropy, masked=True)

    def _begin_micro_step(self):
        """What DeepSpeed's engine.forward does first, which we bypass (we call the decoder, not the
        whole LM, to get hidden states): ZeRO-3 counts micro-steps there, and without it every
        micro-step's gradient overwrites the last instead of adding to it."""
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    def _grad_norm_before_step(self):
        """Global norm of the step's gradient before clipping (TRL's grad_norm) where DeepSpeed keeps
        none: without ZeRO in float32 it clips without keeping the norm. Taken after the boundary
        backward has all-reduced the gradients and before step() applies them; None elsewhere."""
        e = self.engine
        if e.zero_optimization() or e.fp16_enabled() or e.bfloat16_enabled():
            return None
        norms = [torch.linalg.vector_norm(p.grad.float()) for p in self.model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def _inputs(self, mb, logp, old, ref, ent) -> LossInputs:
        return LossInputs(logp=logp, old_logp=old, advantages=mb["advantages"], mask=mb["mask"], ref_logp=ref,
                          sampler_logp=mb["sampler_logp"] if self.tis else None, entropy=ent)

    def _fused_loss(self, mb, old, ref):
        """The forward's weighted GRPO loss (its "weights": learner/forwards.py) from hidden states in one pass."""
        g = self.cfg.grpo
        tis_of = (lambda lp: tis_weight(lp, mb["sampler_logp"], mb["mask"], g.vllm_importance_sampling_cap,
                                        g.vllm_importance_sampling_mode, g.vllm_importance_sampling_clip_min))
        tis = tis_of(old) if self.tis and old is not None else None
        tis_from = None
        if self.tis and old is None:  # on-policy: token modes take the weight inside the loss's lm_head pass
            mode = g.vllm_importance_sampling_mode
            tis_from = TisFromLogp(mb["sampler_logp"], g.vllm_importance_sampling_cap,
                                   g.vllm_importance_sampling_clip_min, mode) if mode.startswith("token") else tis_of
        return completion_grpo_loss(self.model, mb, self.cfg.generation.temperature, mb["weights"], old_logp=old,
                                    ref_logp=ref, tis=tis, tis_from=tis_from, **token_term_params(g))

    # ------------------------------------------------------------------------------- train

    def train(self, groups, export: bool = False) -> dict:
        """One generation cycle: advantages, each optimizer step's forwards, old/ref log-probs, the steps, one version
        up. export: rank 0's result carries the new adapter too (`adapter`: export_adapter's answer), so a publish
        needs no second call while the learner waits for its next batch."""
        t0 = time.time()
        cfg, plan, g = self.cfg, self.plan, self.cfg.grpo
        groups = _resolve(groups)
        if len(groups) != plan.unique_prompts:
            raise ValueError(f"Learner.train: {len(groups)} groups; the batch plan needs {plan.unique_prompts}")
        _check_token_ids(groups, self.model.get_input_embeddings().num_embeddings)
        # in flight the bound is on tokens (docs/grpo.md §6); otherwise the controller bounds whole groups
        s = Samples.from_groups(groups, self.version, token_lag_bound(cfg))
        lengths = torch.tensor([len(c) for c in s.completions])
        rewards, weights = with_overlong_column(torch.from_numpy(s.rewards), lengths, cfg.column_weights(), g,
                                                cfg.generation.max_completion_length)
        adv = compute_advantages(rewards, plan.num_generations, weights, g.scale_rewards)
        # each optimizer step by its plan micro-batches (k within the cycle; PPO epochs repeat them)
        keys = [tuple(m.index % plan.steps_per_generation for m in opt_step) for opt_step in plan.optimizer_steps()]
        forwards = {key: [to_device(f, self.device) for f in self._forwards(s, adv, key)] for key in dict.fromkeys(keys)}
        self.engine.train()
        t_prepared = time.time()
        with torch.no_grad():
            old = {k: [self._logp(f)[0] for f in fs] for k, fs in forwards.items()} if self.needs_old() else None
            ref = {k: [self._logp(f, reference=True) for f in fs] for k, fs in forwards.items()} if g.beta > 0 else None
        step_metrics, tokens, computed, pairs = [], 0, 0, 0
        for key in keys:
            fs = forwards[key]
            step_metrics.append(self._optimizer_step(fs, None if old is None else old[key], None if ref is None else ref[key]))
            tokens += sum(real_tokens(f) for f in fs)  # this rank's
            computed += sum(int(f["input_ids"].numel()) for f in fs)
            pairs += sum(attention_pairs(f) for f in fs)
        self.version += 1
        t_trained = time.time()
        batch_stats = rollout_stats(s, plan.num_generations, weights, self.version - 1, rewards.numpy())
        train_s = time.time() - t0
        batch_stats.update(self._throughput(tokens, pairs, train_s))
        batch_stats.update(train_phases(t0, t_prepared, t_trained, t0 + train_s))
        batch_stats["learner/forwards_per_step"] = sum(map(len, forwards.values())) / len(forwards)
        batch_stats["learner/padding_frac"] = 1 - tokens / max(computed, 1)  # the forward's share spent on padding
        batch_stats.update(self._layout_metrics(), **memory_peaks(self.device))
        for sm in step_metrics:
            sm.update(batch_stats)
            sm["version"] = self.version
            sm["train_s"] = train_s
        out = {"version": self.version, "steps": step_metrics}
        if export and self.rank == 0:
            out["adapter"] = self.export_adapter()
        return out

    def _layout_metrics(self) -> dict:
        """How this learner runs (learner/layout.py's choices), on every step's line."""
        lay = self.layout
        return {"learner/max_tokens_per_forward": float(lay.token_budget or 0),  # 0: the plan's micro-batches
                "learner/gradient_checkpointing": float(lay.checkpointing), "learner/liger_kernel": float(lay.liger),
                "learner/sm_carveout": float(lay.sm_carveout or 0),  # 0: every SM
                "learner/engine_shared_gib": lay.engine_shared_gib}

    def _forwards(self, s: Samples, adv: torch.Tensor, key: tuple) -> list[dict]:
        """One optimizer step's forwards on this rank (plan micro-batches `key`), collated on the host, each with its
        rows' loss weights as their plan micro-batch gives them: the plan's micro-batches, or with a token budget
        their sequences regrouped (every rank running as many forwards)."""
        g, plan, mt = self.cfg.grpo, self.plan, self.cfg.grpo.mask_truncated_completions
        # dapo: active tokens of this optimizer step over every rank (each rank knows all rows)
        n_active = sum(s.loss_mask_counts(plan.rows(k, r), mt) for k in key for r in range(self.world))
        micro = [list(plan.rows(k, self.rank)) for k in key]
        w = plan_weights([loss_mask(s, rows, mt) for rows in micro], [[len(s.completions[i]) for i in rows]
                                                                      for rows in micro], g.loss_type,
                         max_completion_length=self.cfg.generation.max_completion_length, num_active_tokens=n_active)
        weight = {i: x for rows, ws in zip(micro, w) for i, x in zip(rows, ws)}
        if self.layout.token_budget is not None:
            n = lambda i: len(s.prompts[i]) + len(s.completions[i])
            micro = token_budget_bins([[(i, n(i)) for k in key for i in plan.rows(k, r)] for r in range(self.world)],
                                      self.layout.token_budget)[self.rank]
        return [collate(s, rows, adv, pad_id=self.layout.pad_id, mask_truncated=mt, padding_free=self.layout.packed,
                        weights=[weight[i] for i in rows]) | {"samples": rows, "origins": [s.origins[i] for i in rows]}
                for rows in micro]

    def _optimizer_step(self, forwards: list, old, ref) -> dict:
        """The forwards of one optimizer step, then the step. -> its metrics. The host reads nothing back from the
        GPU between forwards (no loss value, no metric), so it keeps queuing work ahead of it: the losses are checked
        once, before the step that would apply them, and the metrics are taken after the step."""
        g = self.cfg.grpo
        GA, W = self.plan.gradient_accumulation_steps, self.world
        losses, inputs = [], []
        for k, mb in enumerate(forwards):
            ref_k = ref[k] if ref is not None else None
            old_k = old[k] if old is not None else None
            last = k == len(forwards) - 1
            self._begin_micro_step()
            # the learner owns the boundary: a token budget runs as many forwards as it needs, not GA
            self.engine.set_gradient_accumulation_boundary(last)
            loss, x = self._micro_batch_loss(mb, old_k, ref_k)
            losses.append(loss.detach())
            inputs.append(x)
            if last:  # before the backward whose step applies the gradient
                self._check_finite(torch.stack(losses), inputs, forwards)
            self.engine.backward(loss * (GA * W))
            if self.engine.is_gradient_accumulation_boundary():
                grad_norm = self._grad_norm_before_step()
                lr = self.scheduler.get_last_lr()[0]  # the rate this step applies (TRL logs that one)
            self.engine.step()
        acc: dict[str, float] = {}
        for x in inputs:
            accumulate(acc, grpo_metrics(x, g, tis=self.tis))
        self.steps += 1
        return reduce_metrics(acc, float(torch.stack(losses).double().sum()), self.world, self.device) | {
            "step": self.steps, "lr": lr,
            "grad_norm": grad_norm if grad_norm is not None else float(self.engine.get_global_grad_norm() or 0.0)}

    def _micro_batch_loss(self, mb: dict, old, ref) -> tuple[torch.Tensor, LossInputs]:
        """One forward's contribution to its optimizer step's objective (docs/grpo.md §4.8) and the inputs its metrics
        read. Fused (learner/logprobs.py: the loss and its gradient in one pass over the lm_head, the TIS weight taken
        inside it where the policy is its own old policy) where the token-level ratio allows; two-pass
        (learner/grpo.py: grpo_loss on the log-probs) for sequence-level ratios and the off-policy mask, which need
        the policy's log-probs before the loss. Scaled by 1/(GA·W) except dapo (already over the step's tokens),
        DeepSpeed's own 1/GA and 1/world averaging undone by the caller's backward."""
        g = self.cfg.grpo
        if g.importance_sampling_level == "token" and g.off_policy_mask_threshold is None:
            loss, logp, ent = self._fused_loss(mb, old, ref)
            x = self._inputs(mb, logp, old if old is not None else logp, ref, ent)
        else:
            logp, ent = self._logp(mb, with_entropy=True)
            x = self._inputs(mb, logp, old if old is not None else logp.detach(), ref, ent)
            loss = grpo_loss(x, g, tis=self.tis, max_completion_length=self.cfg.generation.max_completion_length,
                             token_weight=mb["weights"])
            x = dataclasses.replace(x, logp=logp.detach(), entropy=None if ent is None else ent.detach())
        if g.loss_type != "dapo":
            loss = loss / (self.plan.gradient_accumulation_steps * self.world)
        return loss, x

    def _check_finite(self, losses: torch.Tensor, inputs: list[LossInputs], forwards: list[dict]) -> None:
        """An optimizer step's per-forward losses, read back once: FloatingPointError naming the first non-finite one
        and which of its inputs was not finite where (learner/non_finite.py)."""
        vals = losses.float().tolist()
        bad = next((k for k, v in enumerate(vals) if not math.isfinite(v)), None)
        if bad is None:
            return
        x, mb, g = inputs[bad], forwards[bad], self.cfg.grpo
        w = tis_weight(x.old_logp, x.sampler_logp, x.mask, g.vllm_importance_sampling_cap,
                       g.vllm_importance_sampling_mode, g.vllm_importance_sampling_clip_min) if self.tis else None
        why = describe(non_finite_input(x, w), mb["samples"], mb["origins"], self.plan.num_generations)
        raise FloatingPointError(f"Learner.train: non-finite loss {vals[bad]} at forward {bad} of {len(vals)}: {why}; "
                                 "weights not updated")

    def _throughput(self, tokens: int, pairs: int, seconds: float) -> dict:
        """learner/tokens_per_s: prompt + completion tokens through this rank's training passes per second;
        learner/mfu: the FLOPs those passes do (step_flops: LoRA's frozen weights take no weight gradient, a
        checkpointed forward runs twice) per second over the GPU's dense bf16 peak; learner/mfu_6n: the 6·N
        convention's (training_flops), as verl and nanoGPT report it. The old-log-prob forward is in neither. None
        where the peak is not known (CPU)."""
        s = max(seconds, 1e-9)
        lay = self.layout
        done = step_flops(lay.matmul_params, tokens, pairs, lay.pair_flops, lay.checkpointing)
        six_n = training_flops(lay.n_params, tokens, pairs, lay.pair_flops)
        return {"learner/tokens_per_s": tokens / s,
                "learner/mfu": (done / s / lay.peak_flops) if lay.peak_flops else None,
                "learner/mfu_6n": (six_n / s / lay.peak_flops) if lay.peak_flops else None}

    # ---------------------------------------------------------------------- publish, save

    def export_adapter(self):
        """(version, object ref of the adapter state dict in the model dtype, as a WeightsPayload). Rank 0
        only."""
        import ray

        from tandem.core.protocol import WeightsPayload

        return self.version, ray.put(WeightsPayload.from_torch(self.gathered_state()))

    def _gathered(self, params):
        """ZeRO-3 keeps a partition of each parameter: gather them whole while reading."""
        if self.cfg.cluster.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    def gathered_state(self) -> dict:
        params = [p for p in self.model.parameters() if p.requires_grad or self.cfg.model.lora is None]
        with self._gathered(params):
            return copy_to_cpu(trainable_state_dict(self.model))

    def trainable_parameters(self) -> dict:
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        with self._gathered(p for _, p in named):
            return {n: p.detach().clone().float().cpu() for n, p in named}

    def save_checkpoint(self, directory: str, extra: dict | None = None) -> str:
        return checkpoint_io.save_checkpoint(self, directory, extra)

    def load_checkpoint(self, directory: str) -> dict:
        return checkpoint_io.load_checkpoint(self, directory)

    def barrier(self):
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _resolve(groups: list) -> list:
    """Group refs (from the controller) are fetched here, straight from the workers' object stores."""
    if groups and not hasattr(groups[0], "offsets"):
        import ray

        return ray.get(list(groups))
    return groups
