#!/usr/bin/env bash
# One device call of the end-to-end GPU benchmark: bash bench/device/e2e.sh CANDIDATES [e2e.py options]
# (after ../shared/device/gpu-wheels.sh's parts are installed on the machine). Results land in $OUT/e2e/.
cd "$(dirname "$0")/../.."
for d in services learner rollout kernels; do ln -sfn ../$d tandem/$d; done  # tandem.* from this tree
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
# trl_async needs Hugging Face's kernels package: installed from .parts/trl_async where a call carries it
bash bench/device/trl_async_wheels.sh install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
log="$OUT/log-${1//[^A-Za-z0-9._-]/-}.txt"  # one file name per call: what the device returns (no , : =)
python3 bench/e2e_gpu.py --candidates "$1" --out "$OUT/e2e" --dir /tmp/tandem-e2e "${@:2}" > "$log" 2>&1
rc=$?
grep -v "it/s\]" "$log" | tail -c 9000
exit $rc
