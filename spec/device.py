"""Which device a task takes: the rule the harness applies and users' code is told.

Pure (no torch): :func:`device_index` decides from what a task sees (its local rank, the
node's tasks, how many CUDA devices it can see) and the profile's ``cluster.gpu_binding``;
:func:`task_device` is the same choice as the string users' code gets in ``STO_DEVICE``
(:mod:`spec.user_env`). The harness (:func:`train.harness.dist.pick_device`) asks CUDA,
calls :func:`device_index` and refuses the task at start, before any collective, with
:class:`DeviceError`'s one line; run.json then says ``failed`` with its ``failure``.

Two bindings, because sites differ:

- ``node``: every task of a node sees all the node's GPUs (sbatch ``--gpus-per-node``,
  torchrun): task ``LOCAL_RANK`` takes ``cuda:LOCAL_RANK``. Needs at least as many
  visible devices as the node has tasks.
- ``task``: each task sees only its own GPU (``--gpus-per-task=1``, ``--gpu-bind=single:1``,
  a site's default binding): every task takes ``cuda:0``. Needs exactly one visible device.

Never ``local_rank % device_count``: with fewer devices than tasks it puts several tasks
on one GPU without a word (out of memory, or NCCL's "Duplicate GPU", much later).
"""
from __future__ import annotations

from typing import Optional

from spec.rundir import GPU_BINDING, NO_CUDA

BINDINGS = ("node", "task")


class DeviceError(RuntimeError):
    """A task that cannot take its device: one line naming the host, what the task sees
    and the fix. ``failure`` is run.json's failure class (``no_cuda`` / ``gpu_binding``)."""

    def __init__(self, line: str, failure: str) -> None:
        super().__init__(" ".join(line.split()))  # one line, whatever a driver's message held
        self.failure = failure


def _index(binding: str, local_rank: int) -> int:
    if binding not in BINDINGS:
        raise ValueError(f"cluster.gpu_binding={binding!r}: expected one of {', '.join(BINDINGS)}")
    return local_rank if binding == "node" else 0


def task_device(accelerator: str, binding: str, local_rank: int) -> str:
    """The device a task of a ``cluster.accelerator`` profile takes: "cpu" or "cuda:N"."""
    return f"cuda:{_index(binding, local_rank)}" if accelerator == "gpu" else "cpu"


def _visible(value: Optional[str]) -> str:
    return "unset" if value is None else repr(value)


def device_index(binding: str, local_rank: int, local_world_size: int, device_count: int,
                 visible: Optional[str], host: str) -> int:
    """The CUDA device index of local rank ``local_rank`` (of ``local_world_size`` tasks on
    its node) that sees ``device_count`` devices (``visible``: its CUDA_VISIBLE_DEVICES,
    None when unset), under ``binding``; :class:`DeviceError` when what it sees does not
    fit the binding. Pure."""
    index = _index(binding, local_rank)
    sees = f"{device_count} CUDA device(s) (CUDA_VISIBLE_DEVICES={_visible(visible)})"
    where = f"on {host}: local rank {local_rank} of {local_world_size} sees {sees}"
    if device_count < 1:
        raise DeviceError(f"no CUDA device {where}; check the job's GPU request (--gpus-per-node / "
                          f"--gpus-per-task) or run with cluster.accelerator=cpu", NO_CUDA)
    if binding == "task" and device_count != 1:
        raise DeviceError(f"cluster.gpu_binding=task expects each task to see exactly 1 GPU, but {where}: "
                          f"the site shows every task the node's GPUs: set cluster.gpu_binding=node", GPU_BINDING)
    if binding == "node" and device_count < local_world_size:
        fix = ("the site binds GPUs per task: set cluster.gpu_binding=task" if device_count == 1 else
               f"set cluster.gpu_binding=task if the site binds GPUs per task, else cluster.gpus_per_node<="
               f"{device_count} (one task per GPU)")
        raise DeviceError(f"cluster.gpu_binding=node expects every task to see the node's {local_world_size} "
                          f"GPUs, but {where}: {fix}", GPU_BINDING)
    return index


def no_cuda_line(host: str, torch_version: str, cuda_version: Optional[str], said: str,
                 visible: Optional[str]) -> str:
    """The refusal of a GPU profile's task that finds no usable CUDA. Pure."""
    build = f"CUDA {cuda_version}" if cuda_version else "a CPU build, no CUDA"
    fix = ("install a CUDA build of torch (pip's index for your CUDA version)" if not cuda_version else
           "check the node's driver against this CUDA build and the job's GPU request (--gpus-per-node)")
    return (f"no usable CUDA on {host} for cluster.accelerator=gpu: torch {torch_version} ({build}), "
            f"torch.cuda.is_available() is False, device_count 0 ({said or 'no reason given'}), "
            f"CUDA_VISIBLE_DEVICES={_visible(visible)}; {fix}, or run with cluster.accelerator=cpu")
