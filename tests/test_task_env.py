"""slurm.env.task_env: the one shape of a task's environment, from torchrun's variables,
an srun task's SLURM_* variables, or neither; and back to torchrun's variables."""
from __future__ import annotations

from slurm.env import TaskEnv, rendezvous_port, task_env

SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_RESTART_COUNT": "2"}


def test_an_srun_task():
    t = task_env(SRUN)
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank) == (5, 8, 1, 4, 1)
    assert t.master_addr == "gpu07" and t.master_port == rendezvous_port("4242")
    assert (t.job_id, t.restart_count, t.launcher) == ("4242", 2, "srun")


def test_torchrun_variables_win_and_round_trip():
    t = task_env(SRUN)
    vars_ = t.torchrun_vars()
    assert vars_ == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                     "MASTER_ADDR": "gpu07", "MASTER_PORT": str(rendezvous_port("4242"))}
    back = task_env({**SRUN, **vars_})  # torchrun inside an allocation: its variables are the truth
    assert back.launcher == "torchrun" and back.torchrun_vars() == vars_ and back.job_id == "4242"


def test_no_launcher_is_a_world_of_one():
    assert task_env({}) == TaskEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                                   master_addr="127.0.0.1", master_port=0, job_id="single", launcher="single")
