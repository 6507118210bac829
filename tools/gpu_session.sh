#!/usr/bin/env bash
# Every GPU check for one bundle, on the H200 (the device tool runs this from the repo root):
#
#   run(carry=[".gpu/cute"],       command="tools/gpu_session.sh cute")
#   run(carry=[".gpu/flashinfer"], command="tools/gpu_session.sh flashinfer")
#
# A call can carry only one bundle (64 MiB limit), so the GPU tests run once per bundle; the
# tests that need the other library skip. Writes JUnit XML (and sanitizer logs for cute) under
# $OUT; merge them here with
#
#   python benchmarks/collect_gpu_tests.py --out benchmarks/results/gpu_tests.json --what ... \
#       --command ... junit_cute.xml junit_flashinfer.xml
#
# SANITIZE=0 skips compute-sanitizer (about 2 minutes); PYTEST_ARGS adds pytest arguments.
set -uo pipefail
bundle=${1:?usage: tools/gpu_session.sh cute|flashinfer}
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
# shellcheck disable=SC1090
source ".gpu/$bundle/env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 420 python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --junitxml="$out/junit_$bundle.xml" ${PYTEST_ARGS:-} 2>&1 | tail -6
if [ "$bundle" = cute ] && [ "${SANITIZE:-1}" != 0 ]; then
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_topk.py > "$out/$tool.txt" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E 'SUMMARY' "$out/$tool.txt" | tail -1))"
  done
fi
