"""Fault injection into saves (tests): FaultConfig.kill_in_save_at_step kills every rank
with the shards written and nothing committed. The other fault, a lagging checkpoint
thread (FaultConfig.slow_async_save_s), is ``AsyncSaver``'s ``lag_s``."""
from __future__ import annotations

import os
import signal


def die_before_commit() -> None:
    """Die at once, as a node lost in the middle of a save: SIGKILL, no clean-up."""
    os.kill(os.getpid(), signal.SIGKILL)
