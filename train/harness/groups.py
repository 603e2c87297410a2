"""Process groups a user's code destroys stay referenced until the task exits.

torch's gloo process group joins its worker threads in its destructor, and when the last
reference to it is dropped by a C++ owner that keeps the GIL, such as DDP's ``Reducer``,
that join happens with the GIL held. The usual end of a torchrun script, ``destroy_process_group()``
then ``return`` from ``main`` (the DDP model freed last), can then deadlock: a worker still
releasing the last collective's tensors waits for the GIL that the main thread holds while
it waits for the worker (pytorch/pytorch#56297). Seen with torch 2.13: 2 hangs in 30 runs
of such a script under bare torchrun, and a hung rank of ``examples/session_dcp.py`` in
the suite. A rank that hangs after its work is done holds its allocation until the time
limit.

:func:`keep_destroyed_groups` wraps ``torch.distributed.destroy_process_group`` so the
groups it destroys stay referenced here: the code's own references then never hold the
last one. They are released at exit (atexit: the interpreter still whole, the workers long
idle), from Python, whose binding lets the GIL go first.
"""
from __future__ import annotations

import functools
from typing import Any, List

KEPT: List[Any] = []  # the destroyed groups, until exit


def keep_destroyed_groups() -> None:
    """Wrap ``destroy_process_group`` (once per process) before a user's code runs."""
    import atexit

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if dist.is_initialized():
            world = getattr(getattr(c10d, "_world", None), "pg_map", {})
            KEPT.extend(list(world) if group is None else [group])
        return original(group)

    destroy_process_group.keeps_groups = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
    atexit.register(KEPT.clear)
