#!/usr/bin/env bash
# TRL's AsyncGRPOTrainer (the trl_async candidate) needs Hugging Face's `kernels` package, which
# ../shared/device/gpu-wheels.sh does not carry. Here (no device): `bash bench/device/trl_async_wheels.sh` downloads it
# and what it needs into .parts/trl_async/ (3 MB). On the device, in a call carrying ".parts/trl_async":
# `bash bench/device/trl_async_wheels.sh install` puts them into /tmp/site beside the other carried packages
# (huggingface_hub only where the machine's is older than kernels asks for), and what `vllm serve` imports that
# the GPU wheels lack (model_hosting_container_standards: TRL's server); e2e.sh, agentic.sh and cuda_tests.sh call
# it, and it does nothing where the call carries none or an earlier call installed them.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = install ]; then
  [ -d .parts/trl_async ] || exit 0      # this call carries none
  [ -d /tmp/site/kernels ] && [ -d /tmp/site/model_hosting_container_standards ] && exit 0  # an earlier call's
  hub_ok=$(python3 -c "import huggingface_hub as h; from packaging.version import Version as V; print(int(V(h.__version__) >= V('1.32')))" 2>/dev/null || echo 0)
  wheels=$(ls .parts/trl_async/*.whl | grep -v huggingface_hub || true)
  [ "$hub_ok" = 1 ] || wheels="$wheels $(ls .parts/trl_async/huggingface_hub*.whl)"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade $wheels
  python3 -c "import sys; sys.path.remove('') if '' in sys.path else None; import kernels, huggingface_hub; print('kernels', kernels.__file__, 'huggingface_hub', huggingface_hub.__version__)"
  exit 0
fi
grep -qx '/.parts/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.parts/' >> .git/info/exclude; }
rm -rf .parts/trl_async && mkdir -p .parts/trl_async
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .parts/trl_async \
  kernels==0.19.1 tomlkit 'huggingface_hub>=1.32' model-hosting-container-standards jmespath supervisor
ls -la .parts/trl_async
