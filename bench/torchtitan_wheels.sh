# shellcheck shell=bash
# Sourced by bench/gpu_wheels.sh (`make gpu-wheels`), with its PY, OUT and version(): the
# wheels bench/torchtitan_speed.py needs on the GPU machine (torch 2.11 + CUDA 13, Python
# 3.12, no registry) join the others in .whl/ (or $GPU_WHEELS), which bench/gpu_check.sh
# installs with --no-deps.
#
# torchtitan 0.2.2: the newest release that imports on torch 2.11 (0.3.0 imports
# torch.distributed.fsdp.DataParallelMeshDims, a torch nightly / 2.13 name:
# torchtitan/distributed/full_dtensor.py:23). All pure Python (py3-none-any), 6.4 MB:
#   - torchtitan, and what the import of torchtitan.train + models.llama3 loads:
#     tyro (its CLI / JobConfig) with docstring-parser and typeguard, torchdata
#     (StatefulDataLoader, components/dataloader.py), tensorboard (torch.utils.tensorboard,
#     imported by components/metrics.py even when TensorBoard logging is off) with protobuf
#     (its pure-Python wheel) and absl-py.
# Not carried: datasets (torchtitan imports it at module level, hf_datasets/text_datasets.py,
# but the bench's synthetic loader never calls it; bench/torchtitan_speed.py puts a stub in
# its place when absent: with pyarrow and pandas it would be ~60 MB of cp312 binaries), wandb,
# einops, pillow, torch_checkpointing / spmd_types (0.3.0 only), tomli (Python 3.12 has
# tomllib). Assumed from the image: torch (with triton), numpy, requests / urllib3
# (torchdata), typing_extensions >= 4.14 (typeguard; pydantic of gpu_wheels.sh needs the same).
# Proof without the GPU: tests/test_torchtitan_speed.py; the CPU run in the docstring of
# bench/torchtitan_speed.py.
# pinned: what the CPU runs here used (not in this venv)
titan=(torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
# this venv's versions, as gpu_wheels.sh does
mine=(); for p in tensorboard protobuf absl-py; do mine+=("$p==$(version "$p")"); done
# protobuf: its pure-Python wheel (py3-none-any), not a CPython build of this machine
new=$(mktemp -d); trap 'rm -rf "$new"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --abi none \
  --platform any -d "$new" "${titan[@]}" "${mine[@]}"
printf '%s\n' "$new"/*.whl | grep -v -- '-py3-none-any.whl$' && { echo "torchtitan-wheels: a wheel above is not pure Python" >&2; exit 1; }
mv "$new"/*.whl "$OUT"/
