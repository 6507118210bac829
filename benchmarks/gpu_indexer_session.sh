#!/usr/bin/env bash
# Every GPU check of the fused indexer kernel (kernels/indexer_triton.py) in one device call, from the
# repository root. Needs only torch + triton (no bundle):
#
#   run(kind="nvidia-h200", command="bash benchmarks/gpu_indexer_session.sh")            # all, ~8 min
#   run(command="bash benchmarks/gpu_indexer_session.sh tests")                           # or one part:
#   run(command="bash benchmarks/gpu_indexer_session.sh sanitize")                        #   tests | sanitize | bench
#   run(command="bash benchmarks/gpu_indexer_session.sh bench")
#
# Writes under $OUT: junit_indexer.xml + pytest_indexer.txt (pytest -m gpu tests/test_indexer_kernel.py),
# memcheck_indexer.txt / racecheck_indexer.txt (compute-sanitizer on benchmarks/sanitize_indexer.py),
# local_topk.json / local_topk.md + bench_indexer.txt (benchmarks/bench_local_topk.py; copy the two result
# files into benchmarks/results/). BENCH_ARGS adds benchmark arguments (e.g. "--no-tuning").
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/gpu-indexer}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import dcp_ref.kernels.indexer_triton" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || echo "editable install of the project failed" >&2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 240 python3 -m pytest -m gpu tests/test_indexer_kernel.py -q -p no:cacheprovider \
    --junitxml="$out/junit_indexer.xml" > "$out/pytest_indexer.txt" 2>&1
  echo "pytest -m gpu tests/test_indexer_kernel.py: exit $? ($(tail -1 "$out/pytest_indexer.txt"))"
fi
if [ "$what" = all ] || [ "$what" = sanitize ]; then
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_indexer.py \
      > "$out/${tool}_indexer.txt" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E 'SUMMARY|mismatching' "$out/${tool}_indexer.txt" | tail -2 | tr '\n' ' '))"
  done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  # shellcheck disable=SC2086
  timeout 330 python3 benchmarks/bench_local_topk.py --out "$out" ${BENCH_ARGS:-} > "$out/bench_indexer.txt" 2>&1
  echo "bench_local_topk: exit $?"
  tail -25 "$out/bench_indexer.txt"
fi
