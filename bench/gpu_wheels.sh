#!/usr/bin/env bash
# `make gpu-wheels`: the wheels `make gpu-check` installs on a GPU machine that has its own
# torch (2.11, CUDA 13, Python 3.12) and nothing else of ours, and reaches no registry.
# Built here, on a CPU machine, into .whl/ (git-ignored; carried beside the working tree):
#   - the pure-Python packages the toolkit needs that such an image lacks (Hydra, OmegaConf
#     and its ANTLR runtime, submitit, DeepSpeed -- its sdist builds a pure wheel whose ops
#     compile there on first use, nvcc and ninja present --, hjson, pydantic);
#   - the compiled ones, as CPython 3.12 manylinux wheels (pydantic-core, isal, and torchao for
#     strategy.float8: its cp310-abi3 wheel, which imports on torch 2.11).
# The versions are this venv's, so the GPU machine runs what the suite ran here. What the
# image has already (safetensors, tokenizers, accelerate, transformers, numpy, ...) is not
# carried; wandb is not needed on that path (tracking off by default).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${GPU_WHEELS:-.whl}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$OUT"
rm -f "$OUT"/*.whl
pure=(hydra-core omegaconf antlr4-python3-runtime submitit deepspeed hjson pydantic annotated-types typing-inspection)
binary=(pydantic-core isal torchao)
specs=(); for p in "${pure[@]}"; do specs+=("$p==$(version "$p")"); done
# pip wheel builds sdists (antlr4's runtime, DeepSpeed) into pure wheels; no dependencies.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$OUT" "${specs[@]}"
for p in "${binary[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" "$p==$(version "$p")"
done
# torchtitan's, for the speed/torchtitan row (bench/torchtitan_speed.py)
# shellcheck source=torchtitan_wheels.sh source-path=SCRIPTDIR
source bench/torchtitan_wheels.sh
du -sh "$OUT"
ls "$OUT"
