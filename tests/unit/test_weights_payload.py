"""The published adapter's wire form: every tensor back bit for bit, its bytes out of band (what lets
Ray map them from its object store instead of pickling them through torch.save)."""

import pickle

import pytest
import torch

from tandem.core.protocol import WeightsPayload, as_torch


def state_dict():
    g = torch.Generator().manual_seed(0)
    return {
        "a.lora_A.weight": torch.randn(16, 96, generator=g).to(torch.bfloat16),
        "a.lora_B.weight": torch.randn(96, 16, generator=g).to(torch.float16),
        "b.weight": torch.randn(3, 4, 5, generator=g),
        "b.weight_t": torch.randn(5, 4, generator=g).t(),  # not contiguous
        "count": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "empty": torch.zeros(0, 8),
    }


def test_payload_round_trips_every_dtype_and_shape_exactly():
    sd = state_dict()
    back = pickle.loads(pickle.dumps(WeightsPayload.from_torch(sd), protocol=5))
    got = as_torch(back)
    assert list(got) == list(sd)
    for k, t in sd.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


def test_payload_bytes_travel_out_of_band_and_a_state_dict_passes_as_it_is():
    sd = state_dict()
    bufs = []
    data = pickle.dumps(WeightsPayload.from_torch(sd), protocol=5, buffer_callback=bufs.append)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    assert sum(memoryview(b).nbytes for b in bufs) == nbytes
    assert len(data) < 2000  # names, dtypes and shapes only
    got = as_torch(pickle.loads(data, buffers=bufs))
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert as_torch(sd) is sd


def test_copy_to_cpu_copies_every_tensor_in_order():
    from tandem.learner.model import copy_to_cpu

    sd = state_dict()
    got = copy_to_cpu(sd)
    assert list(got) == list(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    assert all(got[k].data_ptr() != sd[k].data_ptr() for k in sd if sd[k].numel())  # copies, not views


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-transfer-per-dtype path needs a GPU")
def test_copy_to_cpu_from_the_gpu_is_one_transfer_per_dtype_and_exact():
    from tandem.learner.model import copy_to_cpu

    sd = state_dict()
    got = copy_to_cpu({k: v.cuda() for k, v in sd.items()})
    assert list(got) == list(sd)
    for k, t in sd.items():
        assert got[k].device.type == "cpu" and got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_the_published_adapter_is_peft_s_state_dict_and_the_base_config_is_read_once(tmp_path):
    """Each cycle's export is exactly peft's `get_peft_model_state_dict` (with the embedding layers where LoRA
    targets them), and after the first it does not read the base model's config: peft's default looks for a resized
    vocabulary every call, and with the config gone it would warn (or ask the Hub)."""
    import warnings

    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from tandem.learner.model import trainable_state_dict
    from tandem.services.devtools.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m", hidden=32, vocab=256)
    for targets, embeddings in ((["q_proj", "v_proj"], False), (["q_proj", "embed_tokens"], True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's note that it saves the targeted embedding layers
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, target_modules=targets))
            for p in model.parameters():
                if p.requires_grad:
                    p.data.normal_()  # lora_B starts at zero: trained values tell the tensors apart
            want = get_peft_model_state_dict(model)
            first = trainable_state_dict(model)
        assert any(".base_layer." in k and "embed_tokens" in k for k in want) == embeddings
        (path / "config.json").rename(path / "config.json.moved")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                again = trainable_state_dict(model)
        finally:
            (path / "config.json.moved").rename(path / "config.json")
        for got in (first, again):
            assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
