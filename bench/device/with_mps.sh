#!/usr/bin/env bash
# Runs a command under CUDA MPS (one GPU shared by the engine's and the learner's processes: their kernels side by
# side instead of taking turns): bash bench/device/with_mps.sh bash bench/device/e2e.sh tandem_k1 --workload 7b --out "$OUT/e2e_mps".
# A control daemon of this user with its pipe and log under /tmp, stopped at the end; the card's compute mode and
# other settings are not touched (bench/device's METHOD: leave them as found).
export CUDA_MPS_PIPE_DIRECTORY=/tmp/tandem-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tandem-mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if ! command -v nvidia-cuda-mps-control >/dev/null; then echo "with_mps: no nvidia-cuda-mps-control here" >&2; exit 3; fi
nvidia-cuda-mps-control -d || { echo "with_mps: the MPS daemon did not start" >&2; exit 3; }
"$@"
rc=$?
echo quit | nvidia-cuda-mps-control
tail -n 5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
exit $rc
