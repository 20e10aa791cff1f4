"""bench/device/cuda_tests.sh runs every test that needs CUDA: each test file that asks for a GPU (a skip without
one, or a device chosen by torch.cuda.is_available) is in its list."""

import re

from tests.helpers import ROOT

ASKS_FOR_CUDA = re.compile(r"torch\.cuda\.is_available\(\)|skipif\(not CUDA")


def cuda_test_files() -> set[str]:
    return {str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
            if ASKS_FOR_CUDA.search(f.read_text())}


def listed() -> set[str]:
    script = (ROOT / "bench" / "device" / "cuda_tests.sh").read_text()
    block = re.search(r'CUDA_TESTS="([^"]*)"', script)[1]
    return set(block.split())


def test_every_test_that_needs_cuda_is_in_the_gpu_run():
    assert cuda_test_files() - listed() == set()
    assert all((ROOT / f).is_file() for f in listed())
    assert {"tests/unit/test_weights_payload.py", "tests/unit/test_kernels_triton.py"} <= cuda_test_files()
