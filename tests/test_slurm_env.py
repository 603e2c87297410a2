"""Tier 1: SLURM_* parsing and host-list expansion."""
from __future__ import annotations

import pytest

from slurm.env import expand_hostlist, in_srun_task, rendezvous_port, task_identity


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("n[5],m[10-11]", ["n5", "m10", "m11"]),
    ("", []),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01]", "gpu[3-1]", "gpu[a-b]"])
def test_bad_hostlists_raise(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_task_env_from_srun_variables():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "4", "SLURM_RESTART_COUNT": "2"}
    t = task_identity(env)
    assert in_srun_task(env) and t.launcher == "srun"
    assert (t.rank, t.world_size, t.local_rank, t.node_rank) == (5, 8, 1, 1)
    assert t.master_addr == "gpu07"
    assert t.local_world_size == 4 and t.restart_count == 2
    assert t.master_port == rendezvous_port("4242") == 25000 + 4242


def test_not_in_srun_task():
    assert not in_srun_task({"SLURM_JOB_ID": "1"})
    with pytest.raises(KeyError):  # an srun task without its node list
        task_identity({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})


def test_ports_differ_between_jobs_and_stay_in_range():
    ports = {rendezvous_port(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(25000 <= p < 32000 for p in ports)
    # a restart's port too stays below the kernel's ephemeral range (32768-60999 on Linux)
    restarts = {rendezvous_port(str(j), restart=k) for j in range(0, 20000, 7) for k in range(8)}
    assert min(restarts) >= 25000 and max(restarts) < 32000
    assert len({rendezvous_port("4242", restart=k) for k in range(8)}) == 8
    assert rendezvous_port("77_3") == rendezvous_port("773")


@pytest.mark.parametrize("arg", ["--distribution=cyclic", "--distribution=plane=4", "--distribution=arbitrary",
                                 "-mcyclic", "--distribution=Cyclic:block"])
def test_a_distribution_other_than_block_is_refused_at_launch_for_one_task_a_rank(arg):
    """Ranks are numbered node by node: where each rank is an srun task of its own
    (cluster.gpu_binding=task, SLURM_PROCID) srun's cyclic, plane and arbitrary
    distributions are refused in one line; node agents number their ranks themselves."""
    from helpers import compose_run
    from spec.config import ConfigError
    from spec.validate import validate

    with pytest.raises(ConfigError) as refused:
        validate(compose_run(["+cluster=localslurm", "cluster.gpu_binding=task", f"cluster.srun_args=['{arg}']"]))
    line = str(refused.value)
    assert line.startswith(f"cluster.srun_args[0]={arg!r}:") and "--distribution=block" in line and "\n" not in line
    validate(compose_run(["+cluster=localslurm", f"cluster.srun_args=['{arg}']"]))  # agents: accepted


@pytest.mark.parametrize("arg", ["--distribution=block", "--distribution=block:cyclic", "--distribution=*:block"])
def test_block_distributions_pass(arg):
    from helpers import compose_run
    from spec.validate import validate

    validate(compose_run(["+cluster=localslurm", f"cluster.srun_args=['{arg}']"]))


@pytest.mark.parametrize("arg", ["--kill-on-bad-exit=0", "-K0", "--container-name=x"])
def test_the_step_options_the_toolkit_sets_are_refused_in_srun_args(arg):
    from helpers import compose_run
    from spec.config import ConfigError
    from spec.validate import validate

    with pytest.raises(ConfigError, match="the toolkit sets --"):
        validate(compose_run(["+cluster=localslurm", f"cluster.srun_args=['{arg}']"]))
