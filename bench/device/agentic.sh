#!/usr/bin/env bash
# One device call of the agentic benchmark: bash bench/device/agentic.sh prepare|CANDIDATE [agentic.py options]
# (after ../shared/device/gpu-wheels.sh's parts are installed on the machine; `prepare` first, on the same warm
# machine: it builds and warms up the model once under /tmp/tandem-agentic). Results land in $OUT/agentic/.
cd "$(dirname "$0")/../.."
for d in services learner rollout kernels; do ln -sfn ../$d tandem/$d; done  # tandem.* from this tree
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
# trl_async needs Hugging Face's kernels package: installed from .parts/trl_async where a call carries it
bash bench/device/trl_async_wheels.sh install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
log="$OUT/log-$1.txt"
if [ "$1" = prepare ]; then
  python3 bench/agentic.py prepare "${@:2}" > "$log" 2>&1
else
  python3 -c "import sys; sys.path.insert(0, 'bench'); from e2e_gpu import quiet_machine; quiet_machine()"
  python3 bench/agentic.py run "$1" --json "$OUT/agentic/$1.json" "${@:2}" > "$log" 2>&1
fi
rc=$?
grep -v "it/s\]" "$log" | tail -c 9000
exit $rc
