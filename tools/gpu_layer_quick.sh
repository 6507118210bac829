#!/usr/bin/env bash
# One short device call (the H200, kind nvidia-h200): the layer benchmark at the shapes the issues name, in
# priority order, then the quick GPU tests of the scoring kernels. Carries the CuTeDSL
# bundle (the owner-local select-to-slots kernel); without FlashMLA the bf16 attention is the split-KV kernel.
#   run(carry=[".gpu/cute"], command="tools/gpu_layer_quick.sh")
set -uo pipefail
out=${OUT:-/tmp/gpu-layer}; mkdir -p "$out"
# shellcheck disable=SC1091
[ -f .gpu/cute/env.sh ] && source .gpu/cute/env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rows="dcp:1:32:8192:bf16:0,dcp:1:1:8192:bf16:0,dcp:8:32:32768:bf16:0,tp:8:32:32768:bf16:0"
rows="$rows,dcp:8:32:8192:bf16:0,tp:8:32:8192:bf16:0,dcp:8:32:65536:bf16:0,tp:8:32:65536:bf16:0"
rows="$rows,dcp:2:32:8192:bf16:0,tp:2:32:8192:bf16:0,dcp:1:32:8192:bf16:1,dcp:4:32:32768:bf16:0,tp:4:32:32768:bf16:0"
timeout "${LAYER_S:-170}" python3 benchmarks/bench_layer.py --out "$out" --budget-s "${BUDGET_S:-140}" --configs "$rows" \
  2>&1 | tee "$out/bench_layer.log"
timeout 60 python3 -m pytest -m gpu -q tests/test_scoring.py -p no:cacheprovider \
  --junitxml="$out/junit_quick.xml" 2>&1 | tail -5 | tee "$out/pytest_quick.txt"
