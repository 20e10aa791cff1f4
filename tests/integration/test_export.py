"""The trained adapter is an artifact: a checkpoint's `adapter/` loads with real peft and real vLLM, and
`tandem export --merged` gives a plain transformers model; all three score completions as the learner does."""

import json
import shutil

import numpy as np
import pytest
import torch

from tandem.learner.actor import Learner
from tests.helpers import ROOT, make_job
from tests.helpers.learner import make_groups, sgd, started

pytestmark = pytest.mark.integration
TOL = 1e-5  # fp32 on CPU


def seq_logprobs(model, prompt, completion):
    """log p(completion token | prefix), float64-free plain forward: [len(completion)]."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).numpy()


def vllm_logprobs(model_path, adapter, seqs):
    """Scored by vLLM (CPU) with the adapter as a LoRARequest, in a Ray worker of its own."""
    import ray

    from tandem.core.compat import rollout_env_vars

    @ray.remote(num_cpus=1, max_calls=1, runtime_env={"env_vars": rollout_env_vars(0)})
    def score(model_path, adapter, seqs):
        from tandem.core.compat import before_vllm_import

        before_vllm_import()
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        llm = LLM(model=model_path, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                  kv_cache_memory_bytes=256 << 20, enable_lora=True, max_lora_rank=8, max_loras=1,
                  distributed_executor_backend="uni")
        out = []
        for prompt, comp in seqs:
            ids = list(prompt) + list(comp)
            o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                             lora_request=LoRARequest("exported", 1, adapter), use_tqdm=False)[0]
            out.append([o.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(comp)])
        return out

    return ray.get(score.remote(model_path, adapter, seqs))


def test_adapter_loads_in_peft_and_vllm_and_merges(ray_session, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.core.config import JobConfigError
    from tandem.services.app.export import export_merged
    from tandem.services.app.run import publish_artifact

    cfg = make_job(tmp_path, tiny_model, [f"{ROOT}/examples/rewards.py:length_reward"],
                   model={"fast_inference": False}, optimizer={"learning_rate": 0.5, "max_grad_norm": 0.0})
    lr = started(Learner(cfg, optimizer=sgd(0.5)))
    groups = make_groups(lr.plan.unique_prompts, 4, seed=2)
    lr.train(groups)  # one SGD step: lora_B leaves zero, the adapter changes the model
    ck = lr.save_checkpoint(str(tmp_path / "ck" / "cycle-000001"))
    adapter = tmp_path / "ck" / "cycle-000001" / "adapter"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and conf["base_model_name_or_path"].endswith("model")
    assert (adapter / "adapter_model.safetensors").is_file()

    seqs = [(g.prompt_ids.tolist(), g.completion(k).tolist()) for g in groups for k in (0, 1)]
    policy = lr.model.eval()
    ours = [seq_logprobs(policy, p, c) for p, c in seqs]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    plain = [seq_logprobs(base, p, c) for p, c in seqs]
    assert max(np.abs(a - b).max() for a, b in zip(ours, plain)) > 1e-3  # the adapter matters

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                           str(adapter)).eval()
    got = [seq_logprobs(peft_model, p, c) for p, c in seqs]
    assert max(np.abs(a - b).max() for a, b in zip(ours, got)) <= TOL

    got = vllm_logprobs(tiny_model, str(adapter), seqs)
    assert max(np.abs(a - np.asarray(b)).max() for a, b in zip(ours, got)) <= TOL

    merged = export_merged(ck, str(tmp_path / "merged"))
    plain_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not hasattr(plain_model, "peft_config")
    got = [seq_logprobs(plain_model, p, c) for p, c in seqs]
    assert max(np.abs(a - b).max() for a, b in zip(ours, got)) <= TOL
    assert (merged / "tokenizer_config.json").is_file()

    # on a machine that never saw the job's model (the recorded base unreachable): refused naming --base, then with it
    moved = tmp_path / "elsewhere" / "adapter"
    shutil.copytree(adapter, moved)
    conf["base_model_name_or_path"] = "/no/such/machine/runs/model"
    (moved / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(JobConfigError, match=r"'/no/such/machine/runs/model' \(adapter_config.json\) is not a model "
                                             r"directory on this machine; allowed: --base"):
        export_merged(str(moved), str(tmp_path / "merged2"))
    merged2 = export_merged(str(moved), str(tmp_path / "merged2"), base=str(tiny_model))
    got = [seq_logprobs(AutoModelForCausalLM.from_pretrained(merged2, dtype=torch.float32).eval(), p, c) for p, c in seqs]
    assert max(np.abs(a - b).max() for a, b in zip(ours, got)) <= TOL

    # the end of a run: the final checkpoint's adapter also at <output_dir>/adapter, with the model's tokenizer
    run = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"output_dir": str(tmp_path / "run")})})
    dst = publish_artifact(tmp_path / "ck" / "cycle-000001", run)
    assert dst == tmp_path / "run" / "adapter" and (dst / "adapter_model.safetensors").is_file()
    assert (dst / "tokenizer.json").is_file() and AutoTokenizer.from_pretrained(dst).vocab_size > 0


def test_export_names_what_is_missing(tmp_path):
    from tandem.core.config import JobConfigError
    from tandem.services.app.export import export_merged

    with pytest.raises(JobConfigError, match="no adapter here"):
        export_merged(str(tmp_path), str(tmp_path / "out"))
