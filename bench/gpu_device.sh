#!/usr/bin/env bash
# bench.gpu at Qwen3.5-9B's shapes on a Linux box with an NVIDIA GPU, as one prepared script
# (issue 33): a venv with this checkout and mlx's CUDA build, then `python -m bench.gpu` within a
# time budget. Results go under $OUT as the run goes, so a run cut short leaves what it measured:
#   gpu.json        every figure (rewritten after each step)
#   gpu-table.md    the printed table (also made from a partial gpu.json)
#   gpu-run.txt     the run's output; gpu-install.txt the install's; gpu-device.txt the machine
#
#   OUT=/path/to/results bash bench/gpu_device.sh      # from the repository root
#
# Settings (environment):
#   GPU_BUDGET_S    seconds for the benchmark itself, the install not counted (default 480)
#   GPU_PREFIXES    prefix tokens, comma-separated (default 1024,4096,16384)
#   GPU_VENV        the venv to make or reuse (default /tmp/kvstore-gpu-venv)
#   KVSTORE_WHEELS  a folder of wheels to install from instead of the index (a box with no network)
#   GPU_SKIP_INSTALL=1  use GPU_VENV as it is; GPU_ARGS  more bench.gpu arguments (a dry run on a
#                   CPU: GPU_VENV=.venv GPU_SKIP_INSTALL=1 GPU_ARGS=--tiny OUT=/tmp/o bash ...)
#   PYTHON          the interpreter to make the venv with (default python3; 3.10+)
set -u
OUT=${OUT:?set OUT to the folder the results go to}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
VENV=${GPU_VENV:-/tmp/kvstore-gpu-venv}
PY=$VENV/bin/python
log() { echo "[gpu_device $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/gpu-run.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; uname -srm; \
  df -h /tmp | tail -1; } >"$OUT/gpu-device.txt" 2>&1
log "device: $(head -1 "$OUT/gpu-device.txt")"

# 1. the venv: this checkout (editable) and mlx's CUDA 12 build
if [ ! -x "$PY" ]; then
    timeout 120 "${PYTHON:-python3}" -m venv "$VENV" || { log "venv failed"; exit 2; }
fi
PIP=(-m pip install -q --disable-pip-version-check)
if [ -n "${KVSTORE_WHEELS:-}" ]; then
    PIP+=(--no-index --find-links "$KVSTORE_WHEELS")
fi
log "installing: pip install -e . 'mlx[cuda12]'"
if [ -z "${GPU_SKIP_INSTALL:-}" ] && ! timeout 600 "$PY" "${PIP[@]}" -e . 'mlx[cuda12]' >"$OUT/gpu-install.txt" 2>&1; then
    log "install failed (last lines of gpu-install.txt):"
    tail -5 "$OUT/gpu-install.txt" | tee -a "$OUT/gpu-run.txt"
    exit 2
fi
"$PY" -c 'import mlx.core as mx, mlx_lm, kvstore; print("mlx", mx.__version__, "mlx-lm",
mlx_lm.__version__, mx.default_device(), "cuda" if mx.cuda.is_available() else "NO CUDA")' \
    2>&1 | tee -a "$OUT/gpu-run.txt"

# 2. the benchmark, within its budget (each step has its own limit too); SIGTERM, then SIGKILL
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
ARGS=(--out "$OUT/gpu.json" --root /tmp ${GPU_ARGS:-})
if [ -n "${GPU_PREFIXES:-}" ]; then
    ARGS+=(--prefixes "$GPU_PREFIXES")
fi
log "python -m bench.gpu ${ARGS[*]} (budget ${GPU_BUDGET_S:-480} s)"
timeout -k 20 "${GPU_BUDGET_S:-480}" "$PY" -m bench.gpu "${ARGS[@]}" >>"$OUT/gpu-run.txt" 2>&1
rc=$?
[ "$rc" -eq 124 ] && log "budget spent: the table holds the steps that finished"

# 3. the table, from whatever gpu.json holds
if [ -s "$OUT/gpu.json" ]; then
    "$PY" -m bench.gpu --report "$OUT/gpu.json" >"$OUT/gpu-table.md" 2>&1
    cat "$OUT/gpu-table.md"
else
    log "no results: see gpu-run.txt"
fi
log "done (bench.gpu exit $rc)"
exit "$rc"
