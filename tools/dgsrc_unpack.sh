#!/usr/bin/env bash
# Unpack the source build of DeepGEMM (.gpu/dgsrc: ../shared/gpu/deepgemm-src/README.md) on the device, the way
# .gpu/dgsrc/build_and_probe.sh does before it builds or probes, without its build (DG_BUILD=1) or its probe
# (it always probes: all 9 shapes unless PROBE_SHAPES names fewer): seconds instead of minutes.
# From the repo root, carrying .gpu/dgsrc:
#
#   bash tools/dgsrc_unpack.sh && PYTHONPATH=/tmp/dg DG_JIT_CACHE_DIR=/tmp/dgjit python3 -c 'import deep_gemm'
#
#   /tmp/dg     DeepGEMM's sources (dgsrc.tar.xz), the cutlass/cute include links, and deep_gemm._C from
#               prebuilt/ (built on the CPU machine; it loaded and ran correctly on the H200, 2026-12-01)
#   /tmp/dgjit  DeepGEMM's JIT cache seeded with the cubins make-dgsrc built (jitcache.tar.xz)
#
# The same paths as build_and_probe.sh: the JIT cache's keys hold the include path (-I/tmp/dg/deep_gemm/include)
# and nvcc's version, read from $CUDA_HOME/bin/nvcc even on a hit (benchmarks/peer_deepgemm_logits.py sets
# CUDA_HOME as build_and_probe.sh does). DGSRC=folder (default: .gpu/dgsrc of this checkout);
# DG_MAIN=prebuilt|devbuilt (which _C.so; default prebuilt); DG_DEST=/tmp/dg, DG_JIT_DEST=/tmp/dgjit (other
# folders only to test this script: the seeded cache would then miss).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${DGSRC:-$ROOT/.gpu/dgsrc}
MAIN=${DG_MAIN:-prebuilt}
[ -f "$SRC/dgsrc.tar.xz" ] || { echo "dgsrc_unpack: no $SRC/dgsrc.tar.xz (carry .gpu/dgsrc)" >&2; exit 2; }
SO=$(ls "$SRC/$MAIN"/_C*.so 2>/dev/null | head -1 || true)
[ -n "$SO" ] || { echo "dgsrc_unpack: no $SRC/$MAIN/_C*.so" >&2; exit 2; }

DG=${DG_DEST:-/tmp/dg}
JIT=${DG_JIT_DEST:-/tmp/dgjit}

rm -rf "$DG" && mkdir -p "$DG" && tar xJf "$SRC/dgsrc.tar.xz" -C "$DG"
ln -sfn ../../third-party/cutlass/include/cutlass "$DG/deep_gemm/include/cutlass"
ln -sfn ../../third-party/cutlass/include/cute "$DG/deep_gemm/include/cute"
cp "$SO" "$DG/deep_gemm/"
rm -rf "$JIT" && mkdir -p "$JIT"
[ ! -f "$SRC/jitcache.tar.xz" ] || tar xJf "$SRC/jitcache.tar.xz" -C "$JIT"
echo "dgsrc_unpack: $DG ($(du -sh "$DG" | cut -f1), _C.so from $MAIN/), $JIT" \
  "($(ls "$JIT/cache" 2>/dev/null | wc -l) cached kernels)"
