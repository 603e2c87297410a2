"""Where one task stands in its job: the one shape of a task's identity.

Read from the environment once per task (:func:`slurm.env.task_identity`: torchrun's
variables, an srun task's SLURM_* ones, or neither), placed from a layout where no task
exists yet (:meth:`TaskIdentity.placed`: the local launcher's ranks, the dry run), and
written back as the variables torchrun gives a worker (:meth:`TaskIdentity.torchrun_vars`,
the only place that renders them). The harness's process-group context
(``train.harness.dist.DistContext``) is this identity plus what joining gave it.
Pure standard library, cheap to import.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:  # not imported at run time: the preemption flag imports this before its handler exists
    from spec.layout import Layout

# run.json ``failure`` of a task whose rank does not follow block order (:meth:`TaskIdentity.order_error`):
# refused at start, as a task that cannot take its device (train/harness/outcome.py).
RANK_ORDER = "rank_order"

# The variables torchrun gives every worker, in the order :meth:`TaskIdentity.torchrun_vars` writes them.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TaskIdentity:
    """One task's rank, its place on its node, the job's rendezvous point and the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int  # torchrun's GROUP_RANK
    master_addr: str
    master_port: int
    # What run.json records as ``job_id``: Slurm's id of this job ("ARRAYID_TASKID" for an
    # element of a job array: :func:`slurm.env.slurm_job_id`), else torchrun's run id,
    # "local" (torchrun without one) or "single" (a world of one).
    job_id: str
    restart_count: int  # SLURM_RESTART_COUNT (0 outside Slurm)
    launcher: str  # "torchrun" | "srun" | "single": which variables it was read from
    # The batch script's step loop: 0 for the job's first srun, k after k restarts inside
    # the job (slurm.env.in_job_restart); None without such a loop (nothing restarts it).
    in_job_restart: Optional[int] = field(default=None, kw_only=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def placed(cls, layout: Layout, rank: int, master_addr: str, master_port: int, job_id: str = "local",
               launcher: str = "torchrun") -> "TaskIdentity":
        """Task ``rank`` of ``layout`` (its node and local rank by :meth:`Layout.placement`)."""
        node, local = layout.placement(rank)
        return cls(rank=rank, world_size=layout.world_size, local_rank=local, local_world_size=layout.gpus_per_node,
                   node_rank=node, master_addr=master_addr, master_port=master_port, job_id=job_id,
                   restart_count=0, launcher=launcher)

    def order_error(self) -> Optional[str]:
        """Why an srun task's rank does not follow block order, in one line, or None: the
        layout numbers ranks node by node (tensor parallel groups inside a node), so task
        SLURM_PROCID must be SLURM_NODEID x tasks per node + SLURM_LOCALID; a cyclic, plane
        or arbitrary distribution (srun's --distribution, SLURM_DISTRIBUTION) numbers them
        otherwise. Other launchers' ranks are theirs (torchrun numbers node by node)."""
        block = self.node_rank * self.local_world_size + self.local_rank
        if self.launcher != "srun" or self.rank == block:
            return None
        return (f"task SLURM_PROCID={self.rank} on SLURM_NODEID={self.node_rank} with SLURM_LOCALID="
                f"{self.local_rank} ({self.local_world_size} tasks a node) is not in block order (rank {block} "
                "there): ranks must be numbered node by node; remove --distribution from cluster.srun_args "
                "(and SLURM_DISTRIBUTION from the environment) or use --distribution=block")

    def torchrun_vars(self) -> Dict[str, str]:
        """The variables torchrun gives this worker (``TORCHRUN_VARS``)."""
        values = (self.rank, self.world_size, self.local_rank, self.local_world_size, self.node_rank,
                  self.master_addr, self.master_port)
        return dict(zip(TORCHRUN_VARS, map(str, values)))
