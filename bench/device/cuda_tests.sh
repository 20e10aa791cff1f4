#!/usr/bin/env bash
# The tests this CPU skips (CUDA only), run on the GPU machine: bash bench/device/cuda_tests.sh
# (after ../shared/device/gpu-wheels.sh's parts). pytest where the machine has it, else each test called by hand.
cd "$(dirname "$0")/../.."
for d in services learner rollout kernels; do ln -sfn ../$d tandem/$d; done  # tandem.* from this tree
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # tests/conftest.py interprets Triton on the CPU; here the kernels compile
if python3 -m pytest --version >/dev/null 2>&1; then
  exec python3 -m pytest -q -p no:cacheprovider tests/unit/test_fused_layers.py tests/unit/test_padding_free.py \
    tests/integration/test_engine_memory_gpu.py tests/unit/test_sm_carveout.py
fi
python3 - <<'PY'
import pathlib, sys, tempfile, traceback

from tandem.services.devtools.tiny_model import build_tiny_model
import tests.unit.test_fused_layers as fused
import tests.unit.test_padding_free as packed
import tests.integration.test_engine_memory_gpu as engine_memory
import tests.unit.test_sm_carveout as carveout

tiny = str(build_tiny_model(pathlib.Path(tempfile.mkdtemp()) / "m", layers=2, hidden=64, vocab=512, seed=0))
cases = [(fused.test_liger_layers_follow_transformers_on_the_gpu, (tiny,)),
         (fused.test_every_norm_and_mlp_is_patched_and_a_cpu_forward_is_the_models_own, (tiny,)),
         (packed.test_the_flash_varlen_kernel_matches_per_sequence_sdpa_with_grouped_heads, ()),
         (engine_memory.test_an_auto_engine_holds_what_the_controller_keeps_in_it_within_what_the_learner_counts,
          (tiny,)),
         (carveout.test_a_carved_out_matmul_runs_on_fewer_sms_and_computes_the_same, (None,))]  # no fixture: exits
failed = 0
for fn, args in cases:
    try:
        fn(*args)
        print("PASSED", fn.__name__)
    except Exception:
        failed += 1
        print("FAILED", fn.__name__)
        traceback.print_exc()
sys.exit(1 if failed else 0)
PY
