#!/usr/bin/env bash
# Every GPU check of the fused indexer kernel (kernels/indexer_triton.py), from the repository root.
# Needs only torch + triton (no bundle). Two device calls (each stays under the 10-minute limit):
#
#   run(kind="nvidia-h200", command="bash benchmarks/gpu_indexer_session.sh checks")   # pytest -m gpu + sanitizers
#   run(command="bash benchmarks/gpu_indexer_session.sh bench")                        # the benchmark
#
# (`all` runs both in one call: about 9 minutes at worst; `tests` / `sanitize` run one part.)
# Writes under $OUT: junit_indexer.xml + pytest_indexer.txt (pytest -m gpu tests/test_indexer_kernel.py),
# memcheck_indexer.txt / racecheck_indexer.txt (compute-sanitizer on benchmarks/sanitize_indexer.py),
# local_topk.json / local_topk.md + bench_indexer.txt (benchmarks/bench_local_topk.py; copy the two result
# files into benchmarks/results/). BENCH_ARGS replaces the benchmark's extra arguments (default:
# "--tuning-budget 90"; e.g. "--no-tuning").
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/gpu-indexer}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import dcp_ref.kernels.indexer_triton" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || echo "editable install of the project failed" >&2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$what" in all | checks | tests)
  timeout 200 python3 -m pytest -m gpu tests/test_indexer_kernel.py -q -p no:cacheprovider \
    --junitxml="$out/junit_indexer.xml" > "$out/pytest_indexer.txt" 2>&1
  echo "pytest -m gpu tests/test_indexer_kernel.py: exit $? ($(tail -1 "$out/pytest_indexer.txt"))" ;;
esac
case "$what" in all | checks | sanitize)
  for tool in memcheck racecheck; do
    timeout 110 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_indexer.py \
      > "$out/${tool}_indexer.txt" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E 'SUMMARY|mismatching' "$out/${tool}_indexer.txt" | tail -2 | tr '\n' ' '))"
  done ;;
esac
case "$what" in all | bench)
  # shellcheck disable=SC2086
  timeout 300 python3 benchmarks/bench_local_topk.py --out "$out" ${BENCH_ARGS:---tuning-budget 90} \
    > "$out/bench_indexer.txt" 2>&1
  echo "bench_local_topk: exit $?"
  tail -25 "$out/bench_indexer.txt" ;;
esac
