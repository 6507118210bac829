#!/usr/bin/env bash
# Every GPU check and benchmark, on the H200s (nvidia-h200-x2: two GPUs, so NCCL runs too), in three
# device calls made back to back (the machine stays warm ~30 s between calls; both bundles install into
# /tmp/dcp-gpu-site, and a call can carry only one bundle):
#
#   run(kind="nvidia-h200-x2", carry=[".gpu/cute"],       command="tools/gpu_session.sh install-cute")
#   run(carry=[".gpu/flashinfer"], command="tools/gpu_session.sh tests")       # pytest -m gpu
#   run(command="tools/gpu_session.sh bench")                                  # benchmarks + compute-sanitizer
#
# Everything lands under $OUT: junit XML, sanitizer logs, benchmark JSON (copy them into
# benchmarks/results and merge the JUnit files with benchmarks/collect_gpu_tests.py).
set -uo pipefail
what=${1:?usage: tools/gpu_session.sh install-cute|tests|bench}
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
site=/tmp/dcp-gpu-site
use_site() {  # the bundles' site, whichever call installed them
  export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  export CUTE_DSL_ARCH=sm_90a FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed" >&2
}
case "$what" in
  install-cute)
    # shellcheck disable=SC1091
    source .gpu/cute/env.sh
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import cutlass, torch, triton; print('cutlass ok; torch', torch.__version__, 'triton', triton.__version__)"
    ;;
  tests)
    # shellcheck disable=SC1091
    source .gpu/flashinfer/env.sh
    python3 -c "import cutlass, flashinfer, flash_mla; print('cutlass, flashinfer, flash_mla: ok')" || exit 3
    timeout ${PYTEST_TIMEOUT:-540} python3 -m pytest -m gpu tests/ -q -p no:cacheprovider --junitxml="$out/junit_gpu.xml" \
      ${PYTEST_ARGS:-} 2>&1 | tail -25
    ;;
  bench)
    use_site
    python3 benchmarks/bench_step.py --out "$out/step_raw" 2>&1 | tail -8
    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_step.py --out "$out/step_raw" 2>&1 | tail -8
    python3 benchmarks/bench_step.py --merge "$out/step_raw" --out "$out"
    for tool in memcheck racecheck; do
      for script in ${SANITIZE_SCRIPTS:-benchmarks/sanitize_all.py}; do
        [ -f "$script" ] || continue
        name=$(basename "$script" .py)
        timeout 100 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 "$script" > "$out/${tool}_${name}.txt" 2>&1
        echo "compute-sanitizer $tool $name: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/${tool}_${name}.txt" | tail -1))"
      done
    done
    for b in ${BENCH_EXTRA:-}; do
      timeout 240 python3 "$b" --out "$out" 2>&1 | tail -12
    done
    ;;
  *) echo "unknown: $what" >&2; exit 2 ;;
esac
