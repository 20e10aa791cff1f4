"""cluster.learner_sm_carveout: the learner's matmuls leave SMs to an engine sharing the GPU (learner/actor.py:
leave_sms_free). The setting's checks here; what it does to a matmul on a GPU (CUDA only: bench/device/cuda_tests.sh)."""

import time

import pytest
import torch

from tandem.core.config import JobConfig, JobConfigError

JOB = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rewards": ["r:f"]}


def test_the_carveout_is_a_positive_count_of_sms():
    assert JobConfig.from_dict({**JOB, "cluster": {"learner_sm_carveout": 16}}).cluster.learner_sm_carveout == 16
    assert JobConfig.from_dict(JOB).cluster.learner_sm_carveout is None
    with pytest.raises(JobConfigError, match="cluster.learner_sm_carveout"):
        JobConfig.from_dict({**JOB, "cluster": {"learner_sm_carveout": 0}})


@pytest.fixture
def restored_blas():
    before = torch.backends.cuda.preferred_blas_library()
    yield
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: bench/device/cuda_tests.sh")
def test_a_carved_out_matmul_runs_on_fewer_sms_and_computes_the_same(restored_blas):
    from tandem.learner.actor import leave_sms_free

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    with pytest.raises(ValueError, match=f"cluster.learner_sm_carveout = {sms}: .* has {sms} SMs"):
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
