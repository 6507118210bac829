#!/usr/bin/env bash
# dcp-ref developer entry point. Creates/reuses ./.venv, installs the project, then:
#   ./dev.sh lab     open the tutorial (JupyterLab on notebooks/00_overview.ipynb)
#   ./dev.sh test    run every test: pytest (unit + property + Triton-interpreter + CuTeDSL
#                    compile tests) and nbval over every notebook; GPU tests are skipped
#                    without CUDA (run them on a GPU with: ./dev.sh test -m gpu)
#   ./dev.sh lint    ruff check and ruff format --check on dcp_ref/, kernels/, tests/, benchmarks/ and tools/,
#                    mypy on dcp_ref/ and kernels/ (ruff.toml, mypy.ini; `ruff format <dir>` fixes the formatting)
# Extra arguments after `test` go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DCP_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local vpy="$VENV/bin/python"
  local stamp="$VENV/.dcp-ref-installed"
  local want; want=$(cat pyproject.toml | md5sum | cut -c1-12)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # torch first and pinned when nothing is installed yet: an unpinned torch pulls the multi-GB
    # CUDA build on machines that only need the CPU (override with TORCH_SPEC=...).
    if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
      "$vpy" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
    fi
    "$vpy" -m pip install -q -e ".[test,lab,cute,book]"
    echo "$want" > "$stamp"
  fi
}

cmd=${1:-help}; shift || true
case "$cmd" in
  lab)
    setup
    extra=()
    # Jupyter refuses to start as root without this flag (containers, cloud shells).
    [ "$(id -u)" = 0 ] && extra+=(--allow-root)
    exec "$VENV/bin/jupyter" lab "${extra[@]}" notebooks/00_overview.ipynb "$@" ;;
  test)
    setup
    export PYTHONHASHSEED=0 MPLBACKEND=Agg
    exec "$VENV/bin/python" -m pytest -n "${DCP_TEST_WORKERS:-2}" --dist loadfile \
      --nbval --nbval-current-env --nbval-sanitize-with tools/nbval_sanitize.cfg "$@" ;;
  lint)
    setup
    # setup installs them with the test extra; this covers a venv where they went missing since.
    if [ ! -x "$VENV/bin/ruff" ] || [ ! -x "$VENV/bin/mypy" ]; then
      "$VENV/bin/python" -m pip install -q "ruff>=0.6" "mypy>=1.10"  # as pinned in pyproject.toml's test extra
    fi
    # Run all three, then fail if any failed: one run shows every finding.
    rc=0
    lint_dirs=(dcp_ref kernels tests benchmarks tools)
    "$VENV/bin/ruff" check "${lint_dirs[@]}" || rc=1
    "$VENV/bin/ruff" format --check "${lint_dirs[@]}" || rc=1
    "$VENV/bin/mypy" || rc=1  # mypy.ini names the files (dcp_ref, kernels)
    exit $rc ;;
  *)
    sed -n '2,9p' "$0"; exit 2 ;;
esac
