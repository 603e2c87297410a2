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

A user's code that never imports torch (a script of its own, a test's trivial job) does not
pay for importing it here (~2.5 s of CPU a task): the wrap then waits for the code's own
import of ``torch.distributed``.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Any, List

KEPT: List[Any] = []  # the destroyed groups, until exit


def keep_destroyed_groups() -> None:
    """Wrap ``destroy_process_group`` (once per process) before a user's code runs: now if
    ``torch.distributed`` is imported, otherwise as soon as it is."""
    if "torch.distributed" in sys.modules:
        _wrap()
    elif not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands ``torch.distributed``'s spec on with a loader that wraps
    ``destroy_process_group`` once the package has run (its ``__init__`` binds the name)."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)  # once, and the finders below answer
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _wrap()

                spec.loader.exec_module = exec_module  # this spec's own loader instance
                return spec
        return None


def _wrap() -> None:
    import atexit

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "keeps_groups", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if dist.is_initialized():
            from train.torch_compat import live_process_groups  # torch is whole by now

            KEPT.extend(live_process_groups() if group is None else [group])
        return original(group)

    destroy_process_group.keeps_groups = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
    atexit.register(KEPT.clear)
