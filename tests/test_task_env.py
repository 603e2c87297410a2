"""A task's identity (spec.identity.TaskIdentity): read once from the environment by
slurm.env.task_identity (torchrun's variables, an srun task's SLURM_* ones, or neither),
the job id array-aware under every launcher, torchrun's variables rendered in one place.
Pure: environment dicts in, identities out."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from helpers import compose_run
from slurm.env import rendezvous_port, task_identity
from spec.identity import TORCHRUN_VARS, TaskIdentity
from spec.layout import build_layout
from spec.user_env import task_environment
from train.harness.preempt import current_job_id, in_slurm_job

REPO = Path(__file__).resolve().parents[1]
SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_RESTART_COUNT": "2"}
# Element 2 of array 231: its own SLURM_JOB_ID is 233; 231 alone names the whole array.
ARRAY = {"SLURM_ARRAY_JOB_ID": "231", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "233"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "node1", "MASTER_PORT": "29600"}


def test_an_srun_task():
    t = task_identity(SRUN)
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank) == (5, 8, 1, 4, 1)
    assert t.master_addr == "gpu07" and t.master_port == rendezvous_port("4242")
    assert (t.job_id, t.restart_count, t.launcher) == ("4242", 2, "srun") and not t.is_main


def test_torchrun_variables_win_and_round_trip():
    t = task_identity(SRUN)
    vars_ = t.torchrun_vars()
    assert vars_ == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
                     "MASTER_ADDR": "gpu07", "MASTER_PORT": str(rendezvous_port("4242"))}
    back = task_identity({**SRUN, **vars_})  # torchrun inside an allocation: its variables are the truth
    assert back.launcher == "torchrun" and back.torchrun_vars() == vars_ and back.job_id == "4242"


def test_no_launcher_is_a_world_of_one():
    assert task_identity({}) == TaskIdentity(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                                             master_addr="127.0.0.1", master_port=0, job_id="single",
                                             restart_count=0, launcher="single")


def test_torchrun_outside_slurm_takes_its_run_id():
    assert task_identity(TORCHRUN).job_id == "local"
    assert task_identity({**TORCHRUN, "TORCHELASTIC_RUN_ID": "abc"}).job_id == "abc"


@pytest.mark.parametrize("launcher, env", [
    ("torchrun", TORCHRUN),
    ("srun", {**SRUN, "SLURM_JOB_ID": "233"}),
    ("single", {}),
])
def test_an_array_element_is_named_arrayid_taskid_under_every_launcher(launcher, env):
    """The torchrun branch took the raw SLURM_JOB_ID: `scontrol requeue 231` would requeue
    every element of the array."""
    t = task_identity({**env, **ARRAY})
    assert t.launcher == launcher and t.job_id == "231_2"
    assert current_job_id({**env, **ARRAY}) == "231_2"


def test_array_elements_keep_distinct_rendezvous_ports():
    """The port comes from the raw SLURM_JOB_ID, which differs between elements running at once."""
    mine = task_identity({**SRUN, **ARRAY})
    other = task_identity({**SRUN, **ARRAY, "SLURM_JOB_ID": "234", "SLURM_ARRAY_TASK_ID": "3"})
    assert mine.master_port == rendezvous_port("233") != other.master_port
    assert (mine.job_id, other.job_id) == ("231_2", "231_3")


def test_in_slurm_job_is_a_bool_and_the_id_is_asked_apart(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert in_slurm_job() is False and current_job_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert in_slurm_job() is True and current_job_id() == "4242"
    assert in_slurm_job(ARRAY) is True and in_slurm_job({}) is False


def test_placed_tasks_follow_the_layout():
    layout = build_layout(compose_run(["cluster.nodes=2", "cluster.gpus_per_node=4"]))
    t = TaskIdentity.placed(layout, 6, "127.0.0.1", 29501)
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank) == (6, 8, 2, 4, 1)
    assert task_identity(t.torchrun_vars()) == t  # the local launcher's rank reads back what it was given


def test_users_code_gets_the_tasks_own_torchrun_variables(tmp_path):
    """The user's environment renders the identity read from the task (here torchrun's, with
    two ranks a node although the profile says four), not a second copy from the layout."""
    cfg = compose_run(["cluster.gpus_per_node=4"])
    task = task_identity(TORCHRUN)
    env = task_environment(cfg, build_layout(cfg), tmp_path, task=task)
    assert {k: env[k] for k in TORCHRUN_VARS} == task.torchrun_vars() == TORCHRUN
    dry = task_environment(cfg, build_layout(cfg), tmp_path, rank=3)
    assert (dry["RANK"], dry["LOCAL_RANK"], dry["LOCAL_WORLD_SIZE"]) == ("3", "3", "4")
    assert (dry["MASTER_ADDR"], dry["MASTER_PORT"]) == ("<first node of the job>", "<from the job id>")


def test_torchrun_variables_are_rendered_in_one_place():
    """Only spec.identity writes the set torchrun gives a worker; the project reads it elsewhere."""
    writes = re.compile(r"""["'](GROUP_RANK|LOCAL_WORLD_SIZE)["']\s*:|\b(GROUP_RANK|LOCAL_WORLD_SIZE)=""")
    found = [f"{path.relative_to(REPO)}:{n}" for room in ("spec", "slurm", "launcher", "train")
             for path in sorted((REPO / room).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if writes.search(line)]
    assert found == []


def test_the_harness_context_is_the_identity_and_what_joining_gave():
    pytest.importorskip("torch")
    from dataclasses import fields

    from train.harness.dist import DistContext

    assert issubclass(DistContext, TaskIdentity)
    assert [f.name for f in fields(DistContext)][-3:] == ["hostname", "backend", "device"]


# Task 1 of a 2-node step of 2 tasks a node under srun's cyclic distribution: on node 1 as
# its first task (block order would have it on node 0, as its second).
CYCLIC = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2",
          "SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_ID": "41",
          "SLURM_JOB_NODELIST": "node[1-2]"}


def test_a_task_out_of_block_order_is_named_with_the_variables_and_the_fix():
    line = task_identity(CYCLIC).order_error()
    assert line is not None and "\n" not in line
    for part in ("SLURM_PROCID=1", "SLURM_NODEID=1", "SLURM_LOCALID=0", "2 tasks a node", "rank 2 there",
                 "remove --distribution from cluster.srun_args", "--distribution=block"):
        assert part in line
    assert task_identity(SRUN).order_error() is None  # 5 = 1 x 4 + 1: block order
    assert task_identity({**CYCLIC, "SLURM_PROCID": "2"}).order_error() is None
    assert task_identity({**CYCLIC, **TORCHRUN}).order_error() is None  # torchrun's ranks are its own


@pytest.mark.parametrize("workload", ["trainer", "user"])
def test_a_task_out_of_block_order_is_refused_at_start(tmp_path, monkeypatch, workload):
    """The harness's start refuses it before any collective, the built-in trainer's
    (train.harness.run._join) and a user's entry point's (train.harness.user._prepare): one
    line, run.json failed with failure rank_order, the job cancelled (its other tasks would
    wait in the rendezvous), exit status 1."""
    pytest.importorskip("torch")
    from spec.config import to_yaml
    from spec.rundir import CONFIG, ENTRYPOINT, SLURM_REQUEST, read_run_json, update_run_json
    from train.harness.run import _join
    from train.harness.user import _prepare

    overrides = ["+cluster=localslurm", "cluster.nodes=2"] + (["entrypoint=train.py"] if workload == "user" else [])
    (tmp_path / CONFIG).write_text(to_yaml(compose_run(overrides)))
    if workload == "user":
        (tmp_path / ENTRYPOINT).write_text('{"kind": "script", "path": "train.py"}')
    update_run_json(tmp_path, status="submitted")
    logger = logging.getLogger("train.rank1")  # rank_logger keeps a process's first run directory
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in CYCLIC.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as ended:
        (_join if workload == "trainer" else _prepare)(tmp_path)
    assert ended.value.code == 1
    info = read_run_json(tmp_path)
    assert (info["status"], info["failure"]) == ("failed", "rank_order")
    assert "SLURM_PROCID=1" in info["error"] and "--distribution=block" in info["error"]
    assert "action=cancel" in (tmp_path / SLURM_REQUEST).read_text()
    assert "not in block order" in (tmp_path / "logs" / "rank1.log").read_text()
