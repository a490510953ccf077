#!/usr/bin/env bash
# The one command for a GPU machine (after `bash .ci/device_wheels.sh` here): install the carried wheels and the
# project without a network, run `python -m lightning_accel.gpu_check --full`, and put the report into $OUT
# (at most 8 files come back: the report's three, accel-bench's and accel-tune's tables, their logs).
#   run: bash .ci/device_check.sh        carry: [".device"]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
work=$(mktemp -d)
python3 -m lightning_accel.gpu_check --full --out "$work" "$@"
code=$?
for f in gpu_check.md gpu_check.json gpu_check.png bench/bench.md tune/tune.md bench.log tune.log; do
  [ -f "$work/$f" ] && cp "$work/$f" "$out/$(echo "$f" | tr / _)"
done
exit $code
