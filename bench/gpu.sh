#!/usr/bin/env bash
# One-shot GPU check, run from the repo root:   OUT=/some/dir bash bench/gpu.sh [driver args]
#
# Finds a Python whose torch sees CUDA, prints the GPU and software versions, then runs
# bench/gpu_overhead.py (world-1 overhead of zeroshard stage 3 and FSDP2 vs eager, peak memory,
# MFU, a parity check). Everything printed also goes to $OUT/gpu_log.txt; the figures to
# $OUT/gpu_results.json, rewritten after every section so a cut-short run keeps what it measured.
#
# The machine may be offline, so installing is the last resort: an interpreter that already has
# CUDA torch is used as it is, with the package on PYTHONPATH (no pip, no build isolation).
# The whole script stays under GPU_BENCH_BUDGET_S (default 330 s): the driver gets what is left
# after set-up, with a hard timeout, and a soft budget 45 s shorter at which it skips sections.
#
# GPU_BENCH_CPU_SMOKE=1 rehearses the whole script on a machine without a GPU: any torch will do
# and the driver runs a tiny CPU smoke test instead.

set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
BUDGET=${GPU_BENCH_BUDGET_S:-330}
SMOKE=${GPU_BENCH_CPU_SMOKE:-0}

# One line about an interpreter; exit 0 only if its torch sees a GPU (with the smoke flag: has torch).
PROBE='import sys
try:
    import torch
except Exception as e:
    print(sys.executable, sys.version.split()[0], "no torch:", type(e).__name__, e); sys.exit(1)
missing = []
for m in ("numpy", "rich", "safetensors"):
    try:
        __import__(m)
    except Exception:
        missing.append(m)
cuda = torch.cuda.is_available()
print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "built for cuda", torch.version.cuda,
      "cuda available", cuda, "devices", torch.cuda.device_count() if cuda else 0, "missing", missing or "none")
sys.exit(0 if cuda or sys.argv[-1] == "1" else 1)'

probe() { timeout 90 "$1" -c "$PROBE" "$SMOKE" 2>&1 | tail -n 1; return "${PIPESTATUS[0]}"; }
log() { echo "[gpu.sh +$(( $(date +%s) - START ))s] $*"; }

main() {
    log "repo $REPO, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), OUT=${OUT:-<unset>}"

    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 30 nvidia-smi -L
        timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,power.limit,clocks.max.sm,temperature.gpu,utilization.gpu,mig.mode.current --format=csv
    else
        log "nvidia-smi not found"
    fi

    PY=""
    SEEN=" "
    for cand in "$REPO/.venv/bin/python" python3 python /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python; do
        path=$(command -v "$cand" 2>/dev/null) || continue
        real=$(readlink -f "$path")
        case "$SEEN" in *" $real "*) continue ;; esac
        SEEN="$SEEN$real "
        line=$(probe "$path"); rc=$?
        log "python $path: $line"
        if [ "$rc" -eq 0 ]; then PY=$path; break; fi
    done

    if [ -z "$PY" ]; then
        # Last resort, needs a package index: a venv with torch pinned as the Makefile pins it.
        log "no interpreter with CUDA torch; trying to set up .venv (needs network)"
        [ -x .venv/bin/python ] || python3 -m venv .venv || log "python3 -m venv failed"
        if [ -x .venv/bin/python ]; then
            .venv/bin/python -c 'import torch' 2>/dev/null ||
                timeout 150 .venv/bin/python -m pip install --retries 0 --timeout 15 torch==2.13.0 ||
                log "pip install torch failed (offline?)"
            timeout 60 .venv/bin/python -m pip install --retries 0 --timeout 15 -e . ||
                log "pip install -e . failed; relying on PYTHONPATH"
            line=$(probe .venv/bin/python) && PY=$REPO/.venv/bin/python
            log ".venv/bin/python: $line"
        fi
    fi

    if [ -z "$PY" ]; then
        log "FATAL: no Python with CUDA-enabled torch found; nothing measured"
        return 3
    fi

    # No editable install needed (and none attempted on a system interpreter): the repo on the path.
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    log "using $PY"

    LEFT=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$LEFT" -lt 60 ]; then
        log "FATAL: only ${LEFT}s of the ${BUDGET}s budget left after set-up"
        return 4
    fi
    log "driver gets ${LEFT}s (hard), soft budget $(( LEFT - 45 ))s"
    if [ "$SMOKE" = 1 ]; then
        DEVICE_ARGS=(--device cpu --model tiny --steps 3 --rounds 2)
    else
        DEVICE_ARGS=(--device cuda)
    fi
    timeout -k 10 "$LEFT" "$PY" -u bench/gpu_overhead.py "${DEVICE_ARGS[@]}" --budget-s $(( LEFT - 45 )) "$@"
    rc=$?
    case $rc in
        0) log "driver finished OK" ;;
        124|137) log "driver TIMED OUT after ${LEFT}s; the JSON holds the sections that finished" ;;
        *) log "driver exited with $rc (1 = a section failed or parity failed; see above)" ;;
    esac
    [ -n "${OUT:-}" ] && log "files: $(ls "$OUT" 2>/dev/null | tr '\n' ' ')"
    log "total $(( $(date +%s) - START ))s"
    return $rc
}

# A pipeline rather than `exec > >(tee ...)`: the script only exits once tee has written everything.
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    main "$@" 2>&1 | tee -a "$OUT/gpu_log.txt"
    exit "${PIPESTATUS[0]}"
fi
main "$@"
