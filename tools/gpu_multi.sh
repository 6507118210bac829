#!/usr/bin/env bash
# The runs that need several H200s (kinds nvidia-h200-x2 / -x4 / -x8), one device call per kind, ready for the
# session that is lent them. Each call carries the CuTeDSL bundle (the owner-local select-to-slots kernel); the
# bf16 attention is then the split-KV kernel (FlashMLA is in another bundle). Results under $OUT:
#   exchange_W{W}.json    every collective of the layer, NCCL against symmetric memory (bench_collectives.py)
#   layer_W{W}_nccl.json  the whole layer per rank, DCP-W (collectives measured) ...
#   layer_W{W}_symm.json  ... and over symmetric memory
#   junit_step_nccl.xml   the NCCL step test on W GPUs against the oracle (tests/test_step.py -k nccl)
#
#   run(kind="nvidia-h200-x2", carry=[".gpu/cute"], command="tools/gpu_multi.sh")
#   run(kind="nvidia-h200-x4", carry=[".gpu/cute"], command="tools/gpu_multi.sh")
#   run(kind="nvidia-h200-x8", carry=[".gpu/cute"], command="tools/gpu_multi.sh")
# Then: copy $OUT/*.json into benchmarks/results, merge the JUnit with benchmarks/collect_gpu_tests.py, and refit
# the cost model (dcp_ref.costmodel.fit_constants reads the committed results).
set -uo pipefail
out=${OUT:-/tmp/gpu-multi}; mkdir -p "$out"
# shellcheck disable=SC1091
[ -f .gpu/cute/env.sh ] && source .gpu/cute/env.sh
export PYTHONUNBUFFERED=1
W=$(nvidia-smi -L | wc -l)
echo "W = $W GPUs"
run() { timeout "$1" python3 -m torch.distributed.run --nproc_per_node "$W" "${@:2}"; }
run 150 benchmarks/bench_collectives.py --out "$out" 2>&1 | tee "$out/collectives.log"
rows="dcp:$W:32:8192:bf16,dcp:$W:32:65536:bf16,dcp:$W:1:8192:bf16,dcp:$W:128:8192:bf16"
run 200 benchmarks/bench_layer.py --out "$out" --transport nccl --budget-s 150 --configs "$rows" 2>&1 | tee "$out/layer_nccl.log"
run 150 benchmarks/bench_layer.py --out "$out" --transport symm --budget-s 100 --configs "$rows" 2>&1 | tee "$out/layer_symm.log"
timeout 120 python3 -m pytest -m gpu -q tests/test_step.py -k nccl -p no:cacheprovider --junitxml="$out/junit_step_nccl.xml" \
  2>&1 | tail -3
