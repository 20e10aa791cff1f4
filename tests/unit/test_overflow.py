"""learner/overflow.py: the inf/NaN check in one readback gives DeepSpeed's per-tensor answer."""

import zlib

import pytest
import torch
from deepspeed.runtime.utils import has_inf_or_nan as deepspeed_per_tensor

from tandem.learner.overflow import has_inf_or_nan


def deepspeed_serial(tensors) -> bool:
    return any(bool(deepspeed_per_tensor(t)) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf"), 3e38])
def test_one_readback_answers_as_deepspeed_per_tensor(dtype, bad):
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {bad}".encode()))  # each case its own draws, reproducible
    for trial in range(20):  # fresh tensors, a bad value (if any) at a random tensor and position
        shapes = [tuple(torch.randint(1, 9, (2,), generator=g).tolist()) for _ in range(int(torch.randint(1, 8, (), generator=g)))]
        tensors = [torch.randn(s, generator=g).to(dtype) * 10 ** float(torch.randint(-3, 4, (), generator=g)) for s in shapes]
        if bad is not None:
            t = tensors[int(torch.randint(len(tensors), (), generator=g))]
            t.view(-1)[int(torch.randint(t.numel(), (), generator=g))] = bad
        want = deepspeed_serial(tensors)
        assert has_inf_or_nan(tensors) == want, (trial, shapes)
        assert want == (bad is not None and not (abs(bad) < float("inf"))), trial  # 3e38 is finite in both dtypes


def test_empty_and_mixed_dtype_lists():
    assert has_inf_or_nan([]) is False
    assert has_inf_or_nan([torch.empty(0), torch.ones(3, dtype=torch.bfloat16), torch.ones(2)]) is False
    assert has_inf_or_nan([torch.ones(3, dtype=torch.bfloat16), torch.tensor([1.0, float("nan")])]) is True
