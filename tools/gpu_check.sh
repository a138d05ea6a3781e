#!/usr/bin/env bash
# commfold's GPU check: its custom ops on CUDA tensors against their references, each
# pass compiled by Inductor for CUDA on 2 ranks sharing the GPU (gloo) against plain
# Inductor, and the wall time of rewritten vs plain programs; one table at the end.
#
#   bash tools/gpu_check.sh --prepare   here (a registry at hand): the wheels of pytest,
#                                       hypothesis and their dependencies (pure Python,
#                                       versions as installed here) into build/gpu-wheels
#   bash tools/gpu_check.sh             on the GPU machine, from the checkout's root,
#                                       build/gpu-wheels carried along: under 5 minutes;
#                                       exit status pytest's (0: all passed or skipped)
#   bash tools/gpu_check.sh --pick-time on the GPU machine: only the GPU estimate's
#                                       compute side (tools/gpu_pick_time.py: torch
#                                       alone, no wheels, ~1 minute; table also to
#                                       $OUT/gpu_pick_time.{md,json})
#
# commfold runs from the working tree (PYTHONPATH=.). Whatever the machine's Python
# lacks of those wheels' packages is installed from them alone (--no-index) into
# build/gpu-deps, never into its environment. Without a CUDA GPU every check skips.
# Environment: PYTHON (default python, else python3); GPU_CHECK_TIMEOUT (seconds for
# the tests, default 270); OUT (a folder: the table also to $OUT/gpu_check.md, pytest's
# output to $OUT/gpu_check.log, the rows to $OUT/gpu_check_rows.jsonl);
# COMMFOLD_GPU_CHECK_DEVICE=cpu (the same checks on CPU tensors).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

WHEELS=build/gpu-wheels
DEPS=build/gpu-deps
PY=${PYTHON:-$(command -v python || command -v python3)}
LIMIT=${GPU_CHECK_TIMEOUT:-270}

prepare() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS" || return 1
  # pytest as installed here (pyproject bounds it), hypothesis's newest for Python 3.10
  # (the oldest torch 2.11 supports), pure-Python wheels only; pip evaluates markers for
  # this Python, so 3.10's backports are named
  local reqs
  reqs=("$("$PY" -c 'from importlib.metadata import version; print("pytest==" + version("pytest"))' \
          2>/dev/null || echo pytest)" hypothesis exceptiongroup tomli)
  echo "gpu check: downloading ${reqs[*]} and their dependencies into $WHEELS"
  "$PY" -m pip download --quiet --only-binary=:all: --python-version 3.10 \
      --implementation py --abi none --platform any --dest "$WHEELS" "${reqs[@]}" || return 1
  "$PY" tools/gpu_wheels.py check "$WHEELS"
}

importable() {
  PYTHONPATH="$DEPS" "$PY" -c "import $1" 2>/dev/null
}

install_missing() {  # this Python's missing test packages, from the carried wheels only
  importable pytest && importable hypothesis && return 0
  if [ ! -d "$WHEELS" ]; then
    importable pytest && return 0  # hypothesis is optional: its check then skips
    echo "gpu check: no pytest here and no $WHEELS: run 'bash tools/gpu_check.sh" \
         "--prepare' where a registry is reachable and carry $WHEELS" >&2
    return 1
  fi
  local wheels w
  mapfile -t wheels < <(PYTHONPATH="$DEPS" "$PY" tools/gpu_wheels.py missing "$WHEELS")
  [ "${#wheels[@]}" -gt 0 ] || { importable pytest; return; }
  mkdir -p "$DEPS"
  echo "gpu check: installing into $DEPS: ${wheels[*]##*/}"
  if ! "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" \
        --target "$DEPS" "${wheels[@]}"; then
    echo "gpu check: pip failed; unpacking the (pure-Python) wheels instead" >&2
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$DEPS" || return 1; done
  fi
  importable pytest
}

run_checks() {
  local out=${OUT:-} tmp rows log status start
  tmp=$(mktemp -d)
  rows=${out:+$out/gpu_check_rows.jsonl}
  rows=${rows:-$tmp/rows.jsonl}
  log=${out:+$out/gpu_check.log}
  log=${log:-$tmp/pytest.log}
  rm -f "$rows"
  "$PY" -c 'import torch; gpu = torch.cuda.is_available()
print("gpu check: torch", torch.__version__, "| CUDA GPU:",
      torch.cuda.get_device_name(0) if gpu else "none")' || return 2
  local timeout=() files=() f
  command -v timeout >/dev/null && timeout=(timeout -k 10 "$LIMIT")
  # most telling first, the dearest (compiles) late, the likeliest crash last; then any
  # module not named here
  for f in env layer_ops scan_ops passes speed logprobs; do files+=("tests/gpu/test_gpu_$f.py"); done
  for f in tests/gpu/test_gpu_*.py; do [[ " ${files[*]} " == *" $f "* ]] || files+=("$f"); done
  start=$SECONDS
  COMMFOLD_GPU_CHECK_ROWS="$rows" PYTHONPATH=".:$DEPS${PYTHONPATH:+:$PYTHONPATH}" \
    ${timeout[@]+"${timeout[@]}"} "$PY" -m pytest -q -o addopts="" -p no:cacheprovider \
      --confcutdir=tests/gpu --tb=short "${files[@]}" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  echo
  echo "gpu check: pytest exit status $status after $((SECONDS - start)) s"
  "$PY" tools/gpu_check_table.py "$rows" --status "$status" --limit "$LIMIT" \
      ${out:+--out "$out/gpu_check.md"}
  rm -rf "$tmp"
  return "$status"
}

pick_time() {  # one GPU: a rank's pick work over its shard vs the full row's
  local timeout=()
  command -v timeout >/dev/null && timeout=(timeout -k 10 "${PICK_TIME_TIMEOUT:-240}")
  ${timeout[@]+"${timeout[@]}"} "$PY" tools/gpu_pick_time.py ${OUT:+--out "$OUT"}
}

case "${1:-}" in
  --prepare) prepare ;;
  --pick-time) pick_time ;;
  "") install_missing || exit 2; run_checks ;;
  *) echo "usage: bash tools/gpu_check.sh [--prepare | --pick-time]" >&2; exit 2 ;;
esac
