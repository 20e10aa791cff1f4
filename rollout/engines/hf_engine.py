"""transformers `generate` engine (fast_inference=False), TRL's sampler where vLLM is off: a call's prompts in
one left-padded batch, the same sampling parameters as vLLM's, log-probs of the processed scores, the
adapter (peft's LoRA) merged into the weights."""

from __future__ import annotations

import numpy as np

from tandem.rollout.engines.base import Completion, Engine, Sampling

MAX_ROWS = 256  # sequences one generate call holds: vLLM's max_num_seqs on a GPU


class HFEngine(Engine):
    def __init__(self, model_path: str, *, dtype: str = "float32", lora=None, seed: int = 0, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        model.eval()
        self.lora = lora
        if lora is not None:
            from tandem.core.adapter import with_lora

            model = with_lora(model, lora, model_path, dropout=0.0)
            model.eval()
        self.model = model
        self._base = {}  # LoRA layer name -> its base weight as loaded, which every merge starts from
        if lora is not None:
            self._merge()
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.generator_seed = seed
        self.adapter_version: int | None = None
        self.weights_version = 0

    def generate(self, prompts, sampling: Sampling, adapter=None):
        torch = self.torch
        if adapter is not None and adapter != self.adapter_version:
            raise KeyError(f"HFEngine.generate: adapter version {adapter} not loaded (have {self.adapter_version})")
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        rows = [p for chunk in self._chunks(prompts, sampling) for p in self._generate(chunk, sampling)]
        return [rows[j:j + sampling.n] for j in range(0, len(rows), sampling.n)]

    @staticmethod
    def _chunks(prompts, sampling: Sampling) -> list[list[np.ndarray]]:
        """Prompts generated together, left-padded, as TRL's GRPOTrainer does: on a small model a decoding
        step costs the same for 8 rows as for 128, so one prompt at a time paid it once per prompt. At most
        MAX_ROWS rows at once (an evaluation set in one call); one prompt at a time where padding would
        change the numbers: a repetition penalty counts the prompt's tokens, pads included."""
        size = 1 if sampling.repetition_penalty != 1.0 else max(1, MAX_ROWS // sampling.n)
        return [list(prompts[i:i + size]) for i in range(0, len(prompts), size)]

    def _generate(self, prompts, sampling: Sampling) -> list[Completion]:
        """Completions of `prompts`, rows in order: prompt 0's n, then prompt 1's, ..."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row's next token at the same position
            ids[i, width - len(p):] = torch.as_tensor(np.asarray(p, dtype=np.int64))
            mask[i, width - len(p):] = 1
        logprobs = SampledLogProbs()
        # transformers' own warpers, in its order, then the recorder: generate is told to add none of its own
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=True,
                max_new_tokens=sampling.max_tokens, num_return_sequences=sampling.n,
                repetition_penalty=sampling.repetition_penalty, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
                logits_processor=warpers(sampling) + [logprobs], eos_token_id=self.eos_id, pad_token_id=self.pad_id,
                return_dict_in_generate=True)
        new = out.sequences[:, width:]
        logp = logprobs.result(out.sequences).cpu().numpy()
        comps = []
        for i, toks in enumerate(new.tolist()):
            eos = self.eos_id in toks
            k = toks.index(self.eos_id) + 1 if eos else len(toks)
            comps.append(Completion(np.asarray(toks[:k], dtype=np.int32), logp[i, :k].astype(np.float32), eos))
        return comps

    def load_adapter(self, version, tensors):
        from peft import set_peft_model_state_dict

        if self.lora is None:
            raise RuntimeError("HFEngine.load_adapter: engine built without LoRA (model.lora is null)")
        set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in tensors.items()})
        self._merge()
        self.adapter_version = version

    def _merge(self) -> None:
        """The adapter added into its layers' base weights (as vLLM's on CPU, `cluster.vllm_merge_adapter`):
        a decoding step then runs the base model's ops, not four more per LoRA layer (a tenth of the tiny
        CPU model's step). From the weights as loaded, not by subtracting the last merge: no drift over
        thousands of versions in bf16. peft's forward skips the LoRA branch of a merged layer."""
        from peft.tuners.lora import LoraLayer

        torch = self.torch
        with torch.no_grad():
            for name, layer in self.model.named_modules():
                if isinstance(layer, LoraLayer):
                    w = layer.get_base_layer().weight
                    base = self._base.setdefault(name, w.detach().clone())
                    w.copy_((base.float() + layer.get_delta_weight("default").float()).to(w.dtype))
                    layer.merged_adapters = ["default"]

    def load_weights(self, version, tensors):
        self.model.load_state_dict({k: v.to(self.device) for k, v in tensors.items()}, strict=False)
        self.weights_version = version

    def score(self, prompt: np.ndarray, completion: np.ndarray, temperature: float = 1.0) -> np.ndarray:
        """Log-probs of given completion tokens under temperature (no filters): the TIS reference."""
        torch = self.torch
        ids = torch.as_tensor(np.concatenate([prompt, completion]).astype(np.int64), device=self.device)[None]
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        return lp.cpu().numpy()


def warpers(sampling: Sampling) -> list:
    """transformers' sampling warpers for these parameters, in the order `generate` applies them
    (temperature, top-k, top-p, min-p). Temperature 0 is greedy, as vLLM's: top-k 1 (sampling from one token
    keeps num_return_sequences legal)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if sampling.temperature == 0:
        return [TopKLogitsWarper(1)]
    out = [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
    if sampling.top_k:
        out.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p is not None:
        out.append(MinPLogitsWarper(sampling.min_p))
    return out


class SampledLogProbs:
    """Last logits processor of `generate`: the log-probability, under the processed scores, of each token
    sampled. The token drawn from step t's scores is the last input id at step t + 1 (the last one is the
    sequence's), so one step's log-softmax is kept, not every step's scores ([rows, tokens, vocab] fp32:
    1.2 GB a prompt at 8 x 256 tokens of a 152k vocabulary)."""

    def __init__(self):
        self.last, self.steps = None, []

    def __call__(self, input_ids, scores):
        import torch

        if self.last is not None:
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def result(self, sequences):
        """[rows, steps]: the log-probs of the sampled tokens, given generate's output sequences."""
        import torch

        return torch.stack(self.steps + [self.last.gather(-1, sequences[:, -1:]).squeeze(-1)], dim=1)
