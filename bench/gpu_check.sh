#!/usr/bin/env bash
# `make gpu-check` on a GPU machine: the machine's own python3 and torch, the project from
# this working tree, and the wheels of `make gpu-wheels` (in .whl/) when the image lacks
# them. Arguments go to bench/gpu_check.py (--out DIR, --only ROW..., --budget-s S, --dry).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
if ! "$PY" -c "import hydra, submitit, deepspeed, torchao" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu-check: $PY lacks hydra/submitit/deepspeed/torchao and .whl/ holds no wheels: run \`make gpu-wheels\` on a machine with the registries and carry .whl/" >&2
    exit 2
  fi
  site=${GPU_CHECK_SITE:-/tmp/sto-gpu-site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/sto-torch-extensions}
exec "$PY" bench/gpu_check.py "$@"
