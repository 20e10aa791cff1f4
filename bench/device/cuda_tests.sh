#!/usr/bin/env bash
# Every test that needs CUDA (those this CPU skips), and the rest of their files, on the GPU machine:
# bash bench/device/cuda_tests.sh (after ../shared/device/gpu-wheels.sh's parts). The log goes to $OUT/cuda_tests.txt
# where $OUT is set: commit it beside the GPU benchmark run it vouches for. tests/unit/test_cuda_tests.py checks
# that every test file with a CUDA-only test is in CUDA_TESTS below.
cd "$(dirname "$0")/../.."
for d in services learner rollout kernels; do ln -sfn ../$d tandem/$d; done  # tandem.* from this tree
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # tests/conftest.py interprets Triton on the CPU; here the kernels compile
# test_trl_async_attention runs TRL's attention through Hugging Face's kernels package: from .parts/trl_async
bash bench/device/trl_async_wheels.sh install
CUDA_TESTS="tests/unit/test_fused_layers.py tests/unit/test_padding_free.py tests/unit/test_sm_carveout.py
  tests/unit/test_weights_payload.py tests/unit/test_kernels_triton.py tests/unit/test_grpo_loss_path.py
  tests/unit/test_config.py tests/unit/test_trl_async_attention.py tests/integration/test_engine_memory_gpu.py
  tests/unit/test_bench_prepare.py tests/unit/test_learner_memory.py
  tests/unit/test_one_rank_group.py"
log="${OUT:-/tmp}/cuda_tests.txt"
# the card and the commit head the log (-dirty: the tree differs from the commit named)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  git describe --always --dirty 2>/dev/null || true; } | tee "$log"
python3 -m pytest -q -p no:cacheprovider -rs $CUDA_TESTS 2>&1 | tee -a "$log" | tail -40
exit "${PIPESTATUS[0]}"
