#!/usr/bin/env bash
# Prepare .device/ for the GPU machine (`run` with carry [".device"]): it has Python 3.12, torch, lightning,
# torchmetrics and nvidia-ml-py but no network and no Hydra. Builds Hydra's pure-Python wheels (antlr 4.9.3 has
# only a source release) and downloads the cp312 wheels that accel-bench, accel-tune and `gpu_check --full` import.
# Run here, on the development machine: bash .ci/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .device && mkdir -p .device
python3 -m pip wheel -q --no-deps -w .device hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .device pyyaml psutil rich matplotlib
du -sh .device
