"""The cluster section of the run configuration (``cluster.*``): where the job runs and
what it asks of Slurm. Pure; :mod:`spec.config` re-exports it as part of ``RunConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class ClusterConfig:
    """Where the job runs. ``backend=local`` spawns ranks on this machine (no Slurm)."""

    name: str = "local"
    # "local": processes on this machine, torchrun-style env; "slurm": submit with submitit.
    backend: str = "local"
    nodes: int = 1
    # Ranks per node: GPUs per node on GPU clusters, task slots per node on CPU clusters.
    gpus_per_node: int = 2
    # GPUs that share NVLink inside a node; 0 means "all GPUs of the node" (= gpus_per_node).
    # Tensor parallel groups must fit inside one domain. A job using fewer GPUs per node than
    # the domain holds counts them as one domain (min(nvlink_domain, gpus_per_node)).
    nvlink_domain: int = 0
    # "cpu" (gloo, no --gpus-per-node) or "gpu" (nccl, --gpus-per-node=gpus_per_node).
    accelerator: str = "cpu"
    # How a node's GPUs are shown to its ranks, and so how they start:
    #   "node": srun starts one agent a node, which forks the node's ranks (train/harness/
    #           agent.py); every rank sees all the node's GPUs and takes cuda:LOCAL_RANK
    #           (sbatch --gpus-per-node; the default of most sites);
    #   "task": one srun task a rank, each seeing only its own GPU, cuda:0 (sbatch --ntasks
    #           and --gpus-per-task=1, srun --gpus-per-task=1 --gpu-bind=per_task:1; what a
    #           site whose cgroups bind GPUs per task needs). On a CPU profile, "task" asks
    #           one srun task a rank (no GPU options).
    # The task harness checks what it finds against this and refuses a mismatch at start.
    gpu_binding: str = "node"
    # Which CPUs each rank runs on (train/harness/affinity.py):
    #   "gpu":  next to its GPU: the CPUs of its GPU's NUMA node that the task was given,
    #           shared evenly by the node's ranks whose GPUs are there (CPU profiles: an
    #           even split of the task's CPUs among the node's ranks); an explicit
    #           --cpu-bind in srun_args, or a task srun already bound, is kept;
    #   "none": left to Slurm (--cpus-per-task, the site's binding, srun_args).
    cpu_bind: str = "gpu"
    # CPUs Slurm may schedule on one node (`scontrol show node`: CPUTot, less the cores a
    # site keeps for itself with CoreSpecCount/CpuSpecList); null = unknown. With it,
    # cpus_per_task x gpus_per_node is checked against it before submission (a job asking
    # more would be refused or pend forever), and cpus_per_task=0 derives from it.
    cpus_per_node: Optional[int] = None
    # CPUs of each task (sbatch and srun --cpus-per-task: srun does not inherit sbatch's).
    # 0 = floor(cpus_per_node / gpus_per_node), the node's CPUs shared by its tasks.
    cpus_per_task: int = 1
    # Memory per node for sbatch --mem: N = N GB; 0 = --mem=0, all the memory of each node
    # (whole-node GPU jobs: pinned buffers and offload outgrow a site's default per-CPU
    # share); null = the site's default (DefMemPerCPU/DefMemPerNode), for CPU profiles.
    mem_gb: Optional[int] = None
    # Memory in GB a job gets on one node with --mem=0 (`scontrol show node`: RealMemory,
    # in MB there). The planner's host budget for offload when mem_gb=0; null = unknown
    # (the planner assumes 1000 GB on GPU clusters, launcher/plan/memory.py).
    node_mem_gb: Optional[int] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # Nodes to avoid (sbatch --exclude), e.g. "node[3-4]".
    exclude: Optional[str] = None
    # Wall-clock limit in minutes (sbatch --time).
    time_min: int = 60
    # Slurm sends the user signal (USR2) this many seconds before the time limit.
    signal_delay_s: int = 120
    # A step that does not complete within this many seconds is a hang: stacks are dumped,
    # hang.json names the stuck ranks, the job exits (train/harness/watchdog.py). 0 disables.
    # Until a segment's first step completes (build, restore, lazy init) the limit is
    # 3x this, capped at train.dist_timeout_s - 5. Keep it below train.dist_timeout_s
    # and above the slowest step (compile, checkpoint).
    hang_timeout_s: int = 300
    # How many times a run may be requeued after preemption or time limit before it stops.
    max_requeues: int = 3
    # Restarts inside the job: when the training step fails for a reason that is not a
    # preemption, a time limit or a blamed node (a rank's exception, a hang, a rank that
    # died), the batch script starts the ranks again in the same allocation from the last
    # committed checkpoint, up to this many times per job: same job id, no requeue, no
    # queue wait (train/harness/restart.py). Never for a failure before the run's first
    # step (an import error, a bad path), nor twice for the same error at the same step
    # (a crash loop). 0 = a failure ends the run. Slurm jobs only.
    in_job_restarts: int = 3
    # Hot spares: the job asks this many nodes more than it trains on (sbatch
    # --nodes=nodes+spare_nodes, --no-kill: the job outlives a node's death); the training
    # step (srun --nodes=nodes --overlap) runs on `nodes` of them. When a node dies or a
    # failure blames a node (train/harness/badnodes.py), the next in-job restart runs with
    # a spare in its place and the dead node excluded: same job, no requeue, no wait for
    # Slurm's SlurmdTimeout (train/harness/restart.py). Once the spares are used up, a
    # blamed node goes through the exclusion requeue as with 0. 0 = no spares. Slurm jobs
    # with cluster.in_job_restarts >= 1 only; the spares idle (and are billed) meanwhile.
    spare_nodes: int = 0
    # Shell lines run in the batch script before srun (module loads, venv activation).
    setup: List[str] = field(default_factory=list)
    # Environment for every task (NCCL_*, etc.); values are shell-quoted in the script.
    env: Dict[str, str] = field(default_factory=dict)
    # Peak dense bf16 FLOP/s per GPU in TFLOP/s; null = unknown, then MFU is not reported.
    peak_tflops_bf16: Optional[float] = None
    # Memory of one GPU in GB (planner); null = unknown.
    gpu_mem_gb: Optional[float] = None
    # CUDA compute capability of the GPUs (A100 8.0, H100 and H200 9.0); null = unknown.
    # strategy.float8 needs 8.9 or later: refused at launch below it, checked again at start.
    gpu_capability: Optional[float] = None
    # Bandwidths in GB/s per GPU (planner cost model): NVLink inside a node, network across.
    intra_node_gbps: Optional[float] = None
    inter_node_gbps: Optional[float] = None
    # The shared filesystem the checkpoints go to (launcher/plan/checkpoint.py; the shipped
    # profiles' figures and their sources: docs/clusters.md). null = unknown: no interval is
    # derived and no save is timed at launch. GB/s that one node writes (reads), all its
    # ranks together; and that the whole filesystem gives all nodes together, which caps
    # what many nodes get: N nodes write at min(N x fs_write_gbps, fs_total_write_gbps).
    fs_write_gbps: Optional[float] = None
    fs_read_gbps: Optional[float] = None
    fs_total_write_gbps: Optional[float] = None
    fs_total_read_gbps: Optional[float] = None
    # GB the run's checkpoints may take (a quota, or the free space); null = not checked.
    # checkpoint.keep x one checkpoint's size above it is refused at launch.
    checkpoint_quota_gb: Optional[float] = None
    # Failures that end a job (a crash, a dead node, a GPU or network fault) per node-hour;
    # a job of N nodes fails every 1 / (N x this) hours on average (its MTBF), which sets
    # the derived checkpoint interval. null = unknown: no interval is derived.
    failures_per_node_hour: Optional[float] = None
    # Any other sbatch option, by its long name without dashes (exclusive, gres,
    # reservation, mail-type, mail-user, dependency, licenses, ...); true = a flag without
    # value. The options the toolkit sets itself are refused with the field to use.
    sbatch_extra: Dict[str, Any] = field(default_factory=dict)
    # Extra arguments of the srun that starts the tasks (e.g. ["--cpu-bind=cores"]).
    srun_args: List[str] = field(default_factory=list)
    # Containers through pyxis/enroot: srun's --container-image / --container-mounts /
    # --container-workdir (the image needs this project installed).
    container_image: Optional[str] = None
    container_mounts: List[str] = field(default_factory=list)
    container_workdir: Optional[str] = None
    # The Python of the job's tasks: an absolute path or a command on the tasks' PATH.
    # null: with container_image, the image's own `python` (on the container's PATH; the
    # login host's interpreter is not inside the image); without one, the interpreter the
    # launcher runs on (the nodes must see it, as a venv on a shared file system). The
    # batch script's own helpers run outside the container, on the launcher's interpreter.
    python: Optional[str] = None
    # Inside an allocation the user already holds (salloc, or their own sbatch script:
    # SLURM_JOB_ID set, outside any step): "auto" runs the job as srun steps of that
    # allocation (launcher/allocation.py: no new job, no requeue; the nodes asked must fit);
    # "never" (default) submits a job of its own as everywhere else.
    allocation: str = "never"
    # Path of slurm.conf to use; null: $SLURM_CONF, else the system default. The localslurm
    # profile sets "auto": the cluster started by `make cluster-up` is found by itself.
    slurm_conf: Optional[str] = None

    def agent(self) -> bool:
        """srun starts one agent a node that forks the node's ranks (train/harness/agent.py),
        unless GPUs are bound to tasks (gpu_binding=task: one srun task a GPU, as such sites'
        cgroups need)."""
        return self.gpu_binding != "task"

    def task_cpus(self) -> int:
        """CPUs per task as asked of Slurm: cpus_per_task, or with 0 the node's CPUs
        (cpus_per_node) shared by its gpus_per_node tasks (spec/validate.py refuses 0
        without cpus_per_node, and a share under one CPU)."""
        if self.cpus_per_task or not self.cpus_per_node:
            return self.cpus_per_task
        return self.cpus_per_node // self.gpus_per_node


def heartbeat_interval(hang_timeout_s: float) -> float:
    """Seconds between a rank's heartbeats: none (0) when ``cluster.hang_timeout_s`` is 0,
    else a sixtieth of the timeout between 1 and 30 s (5 s at the default 300), so a
    job of thousands of ranks does not write thousands of files a second to a shared
    file system. The hang check and the failure classification run at the same rate."""
    if hang_timeout_s <= 0:
        return 0.0
    return min(30.0, max(1.0, hang_timeout_s / 60))
