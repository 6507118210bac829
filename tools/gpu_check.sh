#!/usr/bin/env bash
# The device check: every `-m gpu` test file and every kernel family under compute-sanitizer, on one H200, in two
# device calls made back to back (the machine stays warm ~30 s after a call; a call carries one bundle, 64 MiB):
#
#   run(carry=[".gpu/cute"], command="DCP_COMMIT=<sha> tools/gpu_check.sh cute")
#   run(carry=[".gpu/flashinfer"], command="DCP_COMMIT=<sha> tools/gpu_check.sh fi")
#
# then, here, on the two files that came back:
#
#   tools/gpu_check.sh merge /work/.device/.../cute.tgz /work/.device/.../fi.tgz   # -> benchmarks/results/gpu_tests.json
#
# `cute` installs CuTeDSL and runs the test files that need no FlashInfer / FlashMLA, and the Triton and CuTeDSL kernel
# families under memcheck and racecheck, all at once (correctness work can share the GPU). `fi` installs FlashInfer +
# FlashMLA beside it (the first call's site must still be there: it checks, and exits 3 on a fresh machine — run both
# again) and runs the files that use them and those families. Every test file of tests/ with a `gpu` mark is in
# exactly one of the two lists (checked here and by tests/test_gpu_check.py). A file gets one pytest process and one
# JUnit file. Benchmarks never share the GPU with anything:
#
#   run(carry=[".gpu/ix_peers", ".gpu/dgsrc"], command="tools/gpu_check.sh bench")   # warm machine, after `fi`
#
# (`.gpu/ix_peers/vllm`: a copy of ../shared/peers/vllm; `.gpu/dgsrc`: ../shared/gpu/deepgemm-src/make-dgsrc.)
#
# Each call packs what it wrote (JUnit XML, logs, sanitizer reports, benchmark JSON) into $OUT/<mode>.tgz.
# CONTRIBUTING.md: every change to kernels/ or the step runs `cute` + `fi` before it lands.
set -uo pipefail
what=${1:?usage: tools/gpu_check.sh cute|fi|bench|merge TGZ...|lists|slim|unslim}
cd "$(dirname "$0")/.."

# ---- which call runs what (edit here when a test file or kernel family is added) ----------------------------------
# One lane = one shell running its units one after another; a call runs its lanes at once (balanced by the times
# measured on the H200, 2026-12-01). A unit is a test file, or FILE@PART for a part of one (kexpr below): the
# parts of a file are complements, so the file runs whole.
CUTE_LANES=(
  "tests/test_topk.py@10k"
  "tests/test_indexer_kernel.py tests/test_local_topk_cutedsl.py tests/test_bad_inputs_scoring.py"
  "tests/test_select_to_slots.py tests/test_scoring.py tests/test_topk.py@rest tests/test_ownership.py"
  "tests/test_deinterleave.py tests/test_bad_inputs_guard.py tests/test_bad_inputs_select_to_slots.py
   tests/test_bad_inputs_contracts.py"
)
FI_LANES=(
  "tests/test_testing_kit.py@select tests/test_testing_kit.py@options"
  "tests/test_testing_kit.py@rest"
  "tests/test_bad_inputs.py tests/test_attention_splitkv.py tests/test_step.py tests/test_step_fp8.py
   tests/test_pipeline.py tests/test_attention.py tests/test_fp8_cache.py tests/test_flashmla_sparse.py"
)
kexpr() {  # the -k expression of a part
  case "$1" in
    10k) echo "differential_10k" ;;
    select) echo "cutedsl_select" ;;
    options) echo "step_options_on_gpu" ;;
    rest) case "$2" in
            *test_topk.py) echo "not differential_10k" ;;
            *) echo "not cutedsl_select and not step_options_on_gpu" ;;
          esac ;;
    *) echo "gpu_check.sh: unknown part @$1" >&2; return 1 ;;
  esac
}
CUTE_TESTS=$(printf '%s\n' "${CUTE_LANES[@]}" | tr ' ' '\n' | grep . | sed 's/@.*//' | sort -u | tr '\n' ' ')
FI_TESTS=$(printf '%s\n' "${FI_LANES[@]}" | tr ' ' '\n' | grep . | sed 's/@.*//' | sort -u | tr '\n' ' ')
CUTE_FAMILIES="pack,deinterleave,lse_merge,indexer,indexer_compact,guard,scoring,splitkv,topk_cutedsl,select_to_slots,local_topk"
FI_FAMILIES="flashinfer,flashmla,flashmla_fp8"
# the layer rows `bench` measures (layout:W:T:ctx:cache), in priority order: the issues' shapes
LAYER_DEFAULT="dcp:1:32:8192:bf16,dcp:1:1:8192:bf16,dcp:8:32:32768:bf16,tp:8:32:32768:bf16"
LAYER_DEFAULT="$LAYER_DEFAULT,dcp:8:32:8192:bf16,tp:8:32:8192:bf16,dcp:8:32:65536:bf16,tp:8:32:65536:bf16"
LAYER_DEFAULT="$LAYER_DEFAULT,dcp:2:32:8192:bf16,tp:2:32:8192:bf16,dcp:4:32:32768:bf16,tp:4:32:32768:bf16"

gpu_marked() { grep -l -E '^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*mark\.gpu)' tests/test_*.py | sort; }
check_lists() {  # every gpu-marked file in exactly one list, every listed file exists
  local listed missing
  listed=$(echo $CUTE_TESTS $FI_TESTS | tr ' ' '\n' | sort)
  missing=$(comm -23 <(gpu_marked) <(echo "$listed" | sort -u))
  [ -z "$missing" ] || { echo "gpu_check.sh: gpu-marked files in neither list: $missing" >&2; return 1; }
  [ "$(echo "$listed" | uniq -d)" = "" ] || { echo "gpu_check.sh: a file in both lists" >&2; return 1; }
  for f in $listed; do [ -f "$f" ] || { echo "gpu_check.sh: listed file missing: $f" >&2; return 1; }; done
}

# The carry: a device call takes the tracked tree plus one bundle, 64 MiB in all; the CuTeDSL bundle (61.5 MB) leaves
# ~5 MB for the tree. When a call is refused as larger than that, `slim` moves what no device call reads (the chapters,
# the CPU-only contract probe, the scoring plan sweep) under .gpu/offcarry (git-ignored, never carried) and `unslim`
# puts it back: run
# `tools/gpu_check.sh slim` before the calls and `tools/gpu_check.sh unslim` after (until then git status shows those
# files deleted; CI and lint need them back).
SLIM_PATHS="notebooks tools/probe_contracts.py benchmarks/results/scoring_sweep.json"
if [ "$what" = slim ] || [ "$what" = unslim ]; then
  for p in $SLIM_PATHS; do
    if [ "$what" = slim ] && [ -e "$p" ]; then
      [ ! -e ".gpu/offcarry/$p" ] || { echo "gpu_check.sh: .gpu/offcarry/$p exists: unslim first" >&2; exit 1; }
      mkdir -p ".gpu/offcarry/$(dirname "$p")" && mv "$p" ".gpu/offcarry/$p"
    elif [ "$what" = unslim ] && [ -e ".gpu/offcarry/$p" ]; then
      [ ! -e "$p" ] || { echo "gpu_check.sh: $p exists beside .gpu/offcarry/$p: resolve by hand" >&2; exit 1; }
      mkdir -p "$(dirname "$p")" && mv ".gpu/offcarry/$p" "$p"
    fi
  done
  echo "gpu_check.sh $what: $SLIM_PATHS"
  exit 0
fi
if [ "$what" = lists ]; then check_lists && echo "cute: $(echo $CUTE_TESTS)" && echo "fi: $(echo $FI_TESTS)"; exit; fi
if [ "$what" = merge ]; then
  shift
  tmp=$(mktemp -d)
  for t in "$@"; do mkdir -p "$tmp/$(basename "$t" .tgz)" && tar xzf "$t" -C "$tmp/$(basename "$t" .tgz)"; done
  # DCP_COMMIT=<sha> here names the tree the calls ran when theirs could not (the device's copy is no clone of it)
  commit=${DCP_COMMIT:-$(cat "$tmp"/*/commit.txt 2>/dev/null | sort -u | tr '\n' ' ')}
  device=$(cut -d, -f1 "$tmp"/*/nvidia_smi.txt 2>/dev/null | sort -u | paste -sd/ -)
  versions=$(cat "$tmp"/fi/versions.json 2>/dev/null || cat "$tmp"/*/versions.json 2>/dev/null | head -1)
  python3 benchmarks/collect_gpu_tests.py --out "${GPU_TESTS_JSON:-benchmarks/results/gpu_tests.json}" \
    --what "tools/gpu_check.sh cute + fi: every -m gpu test file (one pytest process and JUnit file each) and every kernel family under compute-sanitizer memcheck + racecheck" \
    --command "tools/gpu_check.sh cute; tools/gpu_check.sh fi (back to back on one warm machine)" \
    --commit "${commit% }" --versions "${versions:-{\}}" --device "${device:-unknown}" \
    --sanitizer "$tmp"/*/memcheck_*.txt "$tmp"/*/racecheck_*.txt -- "$tmp"/*/junit_*.xml
  exit
fi

out=${OUT:-/tmp/gpu-check}
work=/tmp/gpu-check-work/$what
rm -rf "$work"; mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
pack() { tar czf "$out/$what.tgz" -C "$work" . && echo "packed $(ls "$work" | wc -l) files into $what.tgz"; }
trap pack EXIT
echo "${DCP_COMMIT:-unknown}" > "$work/commit.txt"
check_lists || exit 2
install() {  # $1: the bundle this call carries (.gpu/cute or .gpu/flashinfer)
  # shellcheck disable=SC1091
  [ -f "$1/env.sh" ] && source "$1/env.sh"
  export PYTHONPATH="/tmp/dcp-gpu-site:/tmp/dcp-gpu-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  export CUTE_DSL_ARCH=sm_90a FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed" >&2
  python3 - > "$work/versions.json" <<'PY'
import importlib.metadata as md, json, platform, torch, triton
v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
for name, dist in (("cutlass_dsl", "nvidia-cutlass-dsl"), ("flashinfer", "flashinfer-python"), ("flash_mla", "sgl-flash-mla")):
    try:
        v[name] = md.version(dist)
    except md.PackageNotFoundError:
        pass
print(json.dumps(v))
PY
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$work/nvidia_smi.txt"
}
lane() {  # lane TIMEOUT UNIT...: one pytest process per unit, one after another
  local limit=$1
  shift
  for u in "$@"; do
    local f=${u%@*} name k=()
    name=$(basename "$f" .py)
    if [ "$u" != "$f" ]; then
      name="${name}_${u#*@}"
      k=(-k "$(kexpr "${u#*@}" "$f")")
    fi
    timeout "$limit" python3 -m pytest -m gpu "$f" "${k[@]}" -q -p no:cacheprovider --junitxml="$work/junit_$name.xml" \
      > "$work/pytest_$name.txt" 2>&1
    echo "$u: exit $? — $(tail -1 "$work/pytest_$name.txt")"
  done
}
san() {  # san TOOL FAMILIES: compute-sanitizer over sanitize_all.py
  local tool=$1 fams=$2
  timeout "${SAN_S:-400}" compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_all.py \
    --only "$fams" --out "$work/sanitize_$tool" > "$work/${tool}_$what.txt" 2>&1
  echo "compute-sanitizer $tool ($fams): exit $? — $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$work/${tool}_$what.txt" | tail -1)"
}
run_lanes() {  # run_lanes TIMEOUT LANE...: every lane at once, in the background
  local limit=$1
  shift
  for l in "$@"; do
    # shellcheck disable=SC2086
    lane "$limit" $l &
  done
}

case "$what" in
  cute)
    install .gpu/cute
    python3 -c "import cutlass, torch, triton; print('cutlass ok; torch', torch.__version__, 'triton', triton.__version__)" || exit 3
    run_lanes "${TEST_S:-420}" "${CUTE_LANES[@]}"
    (san memcheck "$CUTE_FAMILIES"; san racecheck "$CUTE_FAMILIES") &
    wait
    ;;
  fi)
    install .gpu/flashinfer
    python3 -c "import cutlass, flashinfer, flash_mla; print('cutlass, flashinfer, flash_mla: ok')" \
      || { echo "fresh machine: CuTeDSL from the 'cute' call is gone; run both calls again" >&2; exit 3; }
    run_lanes "${TEST_S:-420}" "${FI_LANES[@]}"
    (san memcheck "$FI_FAMILIES"; san racecheck "$FI_FAMILIES") &
    wait
    ;;
  bench)  # the benchmarks whose JSON the chapters read, one at a time (after `cute` + `fi` on the warm machine)
    install .gpu/none
    python3 -c "import cutlass, flashinfer, flash_mla" || { echo "fresh machine: run cute + fi first" >&2; exit 3; }
    b() {  # b NAME TIMEOUT SCRIPT ARGS...
      local name=$1 limit=$2
      shift 2
      timeout "$limit" python3 "$@" > "$work/bench_$name.txt" 2>&1
      echo "== $name: exit $? ($(tail -1 "$work/bench_$name.txt" | cut -c1-150))"
    }
    # BEFORE=<dir>: also time the layer and step rows on an older tree (its dcp_ref/ with the kernels copied in as
    # dcp_ref/kernels, and its benchmarks/: see CONTRIBUTING) in the same call, right after this tree's, into
    # $work/before — the before/after of a refactor measured on one machine in one session.
    before() {  # before NAME TIMEOUT SCRIPT ARGS...: one benchmark of the older tree (its dcp_ref first on the path)
      [ -n "${BEFORE:-}" ] && [ -d "$BEFORE/dcp_ref/kernels" ] || return 0
      local name=$1 limit=$2
      shift 2
      mkdir -p "$work/before"
      (cd "$BEFORE" && PYTHONPATH="$PWD:$PYTHONPATH" timeout "$limit" python3 "$@") > "$work/before/bench_$name.txt" 2>&1
      echo "== before $name: exit $? ($(tail -1 "$work/before/bench_$name.txt" | cut -c1-150))"
    }
    for bname in ${BENCH:-local_topk layer step validation scoring}; do
      case "$bname" in
        local_topk) b local_topk 200 benchmarks/bench_local_topk.py --out "$work" --peers .gpu/ix_peers/vllm --no-sweep ;;
        layer)
          b layer "${LAYER_S:-170}" benchmarks/bench_layer.py --out "$work" --budget-s $(( ${LAYER_S:-170} - 30 )) \
            --configs "${LAYER_ROWS:-$LAYER_DEFAULT}"
          before layer "${LAYER_S:-170}" benchmarks/bench_layer.py --out "$work/before" --budget-s $(( ${LAYER_S:-170} - 30 )) \
            --configs "${LAYER_ROWS:-$LAYER_DEFAULT}" ;;
        step)  # W = 1 on both caches (W = 2 needs two GPUs: its rows stay from their run, marked so)
          b step 200 benchmarks/bench_step.py --out "$work/step_raw" ${STEP_ARGS:-}
          b step_fp8 150 benchmarks/bench_step.py --fp8 --out "$work/step_raw" ${STEP_ARGS:-}
          before step 200 benchmarks/bench_step.py --out "$work/before/step_raw" ${STEP_ARGS:-}
          before step_fp8 150 benchmarks/bench_step.py --fp8 --out "$work/before/step_raw" ${STEP_ARGS:-}
          python3 benchmarks/bench_step.py --merge "$work/step_raw" --out "$work" --keep benchmarks/results/step.json \
            --note "tools/gpu_check.sh bench: W = 1, one H200, the two caches one after the other." > /dev/null ;;
        validation) b validation 150 benchmarks/bench_validation.py --out "$work" ;;
        attention_splits) b attention_splits 200 benchmarks/bench_attention.py --out "$work" --only-splits ;;
        combine_sweep) b combine_sweep 150 benchmarks/sweep_combine.py --out "$work" ;;
        scoring)  # DeepGEMM's fp8_paged_mqa_logits (built from source, .gpu/dgsrc) in its own process, then ours
          dg=()
          if [ -d .gpu/dgsrc ] && bash tools/dgsrc_unpack.sh > "$work/dgsrc_unpack.txt" 2>&1; then
            PYTHONPATH=/tmp/dg DG_JIT_CACHE_DIR=/tmp/dgjit timeout 240 python3 benchmarks/peer_deepgemm_logits.py \
              --out "$work/deepgemm_logits.json" --budget 200 > "$work/bench_deepgemm.txt" 2>&1
            echo "== deepgemm peer: exit $? ($(tail -1 "$work/bench_deepgemm.txt" | cut -c1-150))"
            [ -f "$work/deepgemm_logits.json" ] && dg=(--deepgemm "$work/deepgemm_logits.json")
          fi
          b scoring 300 benchmarks/bench_scoring.py --out "$work" --peers .gpu/ix_peers/vllm --no-sweep "${dg[@]}" ;;
      esac
    done
    ;;
  *) echo "unknown mode: $what" >&2; exit 2 ;;
esac
