#!/usr/bin/env bash
# The data path's GPU checks in one run: at most ~10 minutes on one H200 (the step
# limits add up to 580 s), usually far less:
#   1. env: the machine: GPU, torch, and whether pytest/hypothesis/numpy import;
#   2. pytest: the data-path tests, CPU and CUDA variants (cuda-marked ones included);
#   3. transfer, transfer_tensor: bench/transfer_bench.py on CUDA: store/load GB/s next to
#      pinned cudaMemcpy, with the default copier (4-16 KiB blocks through the staging
#      buffer) and, side by side, with one copy_ per run (--copier tensor);
#   4. overlap: a bf16 matmul loop alone and while stores run (2 MiB blocks, and 4 KiB
#      per-layer blocks on the staging path).
# Each step has its own timeout, and a failing step does not stop the others; a step's rc
# is the status of its first command that failed (124 or 137: out of time). The script
# exits 0 only if every step did. Outputs land in $OUT, by default a new temporary
# directory (nothing is written into the checkout): env.log, pytest.log, transfer.log,
# transfer_cuda.json, transfer_tensor.log, transfer_cuda_tensor.json, overlap.log,
# overlap.json, summary.txt. STEPS="env pytest" runs only the steps named.
#
# The project is used from the working tree (PYTHONPATH=spec:impl): nothing is built or
# downloaded. If pytest or hypothesis is missing and wheels were carried in ./.whl, they
# are installed from there into /tmp/site (no network).
#
#   bash bench/gpu_check.sh            # or: OUT=/some/dir PYTHON=python3 bash bench/gpu_check.sh

set -u
set -x

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
ALL_STEPS="env pytest transfer transfer_tensor overlap"
STEPS="${STEPS:-$ALL_STEPS}"
STEPS="${STEPS//,/ }"
for name in $STEPS; do
    case " $ALL_STEPS " in
    *" $name "*) ;;
    *) echo "STEPS: no step named '$name' (the steps: $ALL_STEPS)" >&2; exit 2 ;;
    esac
done
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" || exit 1
else
    OUT="$(mktemp -d "${TMPDIR:-/tmp}/kvoffload-gpu-check.XXXXXX")" || exit 1
fi
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT/spec:$ROOT/impl:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export KVOFFLOAD_HYPOTHESIS_PROFILE="${KVOFFLOAD_HYPOTHESIS_PROFILE:-ci}"
SUMMARY="$OUT/summary.txt"
echo "outputs in $OUT" | tee "$SUMMARY"
started=$(date +%s)
failed=""

# step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, record rc
# (unless STEPS leaves NAME out).
step() {
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    local begin=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc=$rc ($(($(date +%s) - begin)) s, limit $limit s)" | tee -a "$SUMMARY"
    [ "$rc" -eq 0 ] || failed="$failed $name"
    return 0
}

# Every command runs, and the step's status is the first failure's: a traceback in the
# middle must not hide behind a last command that worked.
step env 30 bash -c '
    rc=0
    check() {
        "$@"
        local status=$?
        if [ "$status" -ne 0 ]; then
            echo "env: rc=$status from: $*"
            [ "$rc" -ne 0 ] || rc=$status
        fi
    }
    check nvidia-smi
    check uname -a
    check "$0" --version
    check "$0" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"
    check "$0" -c "import numpy, pytest, hypothesis; print(numpy.__version__, pytest.__version__, hypothesis.__version__)"
    exit "$rc"
' "$PY"

if ! "$PY" -c 'import pytest, hypothesis, numpy' 2>/dev/null; then
    if [ -d .whl ]; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    "$PY" -c 'import pytest, hypothesis, numpy' || echo "pytest/hypothesis/numpy missing" | tee -a "$SUMMARY"
fi

step pytest 220 "$PY" -m pytest -q -rs --durations=10 \
    tests/test_layout.py tests/test_transfer.py tests/test_run_planner.py tests/test_copiers.py tests/test_offloader.py \
    tests/test_offloader_stateful.py

step transfer 140 "$PY" bench/transfer_bench.py --device cuda --out "$OUT/transfer_cuda.json"

step transfer_tensor 140 "$PY" bench/transfer_bench.py --device cuda --copier tensor \
    --out "$OUT/transfer_cuda_tensor.json"

step overlap 50 "$PY" bench/transfer_bench.py --overlap --out "$OUT/overlap.json"

echo "total: $(($(date +%s) - started)) s" | tee -a "$SUMMARY"
case " $STEPS " in *" pytest "*) tail -n 1 "$OUT/pytest.log" | tee -a "$SUMMARY" ;; esac
if [ -n "$failed" ]; then
    echo "failed:$failed (outputs in $OUT)" | tee -a "$SUMMARY"
    exit 1
fi
echo "every step passed (outputs in $OUT)" | tee -a "$SUMMARY"
