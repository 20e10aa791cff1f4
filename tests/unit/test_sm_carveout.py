"""cluster.learner_sm_carveout: the learner's matmuls leave SMs to an engine sharing the GPU
(learner/sm_carveout.py). The setting's checks and what auto chooses here; what it does to a matmul on a GPU (CUDA
only: bench/device/cuda_tests.sh)."""

import time

import pytest
import torch

from tandem.core.config import JobConfig, JobConfigError
from tandem.learner.sm_carveout import carveout_sms

JOB = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r:f"]}


def test_the_carveout_is_a_positive_count_of_sms_auto_or_null():
    carve = lambda v: JobConfig.from_dict({**JOB, "cluster": {"learner_sm_carveout": v}}).cluster  # noqa: E731
    assert carve(16).learner_sm_carveout == 16 and carve(None).learner_sm_carveout is None
    assert JobConfig.from_dict(JOB).cluster.learner_sm_carveout == "auto"
    for bad in (0, -4):
        with pytest.raises(JobConfigError, match=f"cluster.learner_sm_carveout = {bad}; allowed: an int >= 1, auto"):
            carve(bad)


def test_auto_leaves_the_engine_a_share_of_the_sms_only_where_it_runs_beside_the_learner():
    assert carveout_sms("auto", "colocate", 132, True) == 24  # H100, H200
    assert carveout_sms("auto", "colocate", 108, True) == round(108 * 24 / 132) == 20  # A100
    assert carveout_sms("auto", "colocate", 2, True) == 1
    # two processes take turns on the GPU; a torch without the carveout; a GPU of one SM: none
    assert carveout_sms("auto", "server", 132, True) is None
    assert carveout_sms("auto", "colocate", 132, False) is None
    assert carveout_sms("auto", "colocate", 1, True) is None
    # a number or null is the user's, whatever the mode
    assert carveout_sms(40, "server", 132, True) == 40 and carveout_sms(None, "colocate", 132, True) is None


@pytest.fixture
def restored_blas():
    before = torch.backends.cuda.preferred_blas_library()
    yield
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: bench/device/cuda_tests.sh")
def test_a_carved_out_matmul_runs_on_fewer_sms_and_computes_the_same(restored_blas):
    from tandem.learner.sm_carveout import leave_sms_free

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    with pytest.raises(ValueError, match=f"cluster.learner_sm_carveout = {sms}: .* has {sms} SMs; allowed: 1 to {sms - 1}, auto, or null"):
        leave_sms_free(sms, dev)
    a, b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16), torch.randn(8192, 8192, device=dev,
                                                                                  dtype=torch.bfloat16)

    def timed():
        a @ b
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            c = a @ b
        torch.cuda.synchronize()
        return time.perf_counter() - t, c

    whole, ref = timed()
    leave_sms_free(sms - 8, dev)  # 8 SMs left to the matmul: several times slower if the carveout holds
    assert torch._C._get_sm_carveout_experimental() == sms - 8
    carved, out = timed()
    assert torch.equal(out, ref) or torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-1)
    assert carved > 3 * whole, (carved, whole)
