"""Hot spares (cluster.spare_nodes), without Slurm: the batch script asked for N+K nodes
and its step loop run by bash with stand-ins for Slurm's client, the validation, and the
tasks' decision to restart without a blamed node (train/harness/restart.py). On the real
cluster: tests/test_hot_spares_slurm.py."""
from __future__ import annotations

import logging
import os
import stat
import subprocess
from pathlib import Path

import pytest

from helpers import CLIENT, compose_run, run_step_loop, stuck_srun
from launcher.resources import resources_line
from launcher.submit import render_script
from slurm import submitit_adapter
from slurm.states import restart_refusal
from spec.config import ConfigError, to_run_config, to_yaml
from spec.layout import build_layout
from spec.rundir import CONFIG, RESTART, read_run_json, update_run_json
from spec.validate import validate
from test_in_job_restart import Beats, identity, started_segment
from test_sbatch import RUN_DIR, WRAPPER, sbatch_flags
from train.harness.restart import Restart, dropped_nodes

SPARE = ["+cluster=localslurm", "cluster.nodes=2", "cluster.spare_nodes=1"]


def script_of(overrides) -> str:
    cfg = compose_run(overrides)
    validate(cfg)
    return render_script(cfg, build_layout(cfg), RUN_DIR, python="/opt/venv/bin/python", wrapper=WRAPPER)


def test_the_job_asks_for_the_spares_and_the_step_for_the_training_nodes():
    script = script_of(SPARE)
    flags = sbatch_flags(script)
    assert flags["--nodes"] == "3" and "--no-kill" in flags and flags["--ntasks-per-node"] == "1"  # an agent a node
    # slurm/step_loop.sh's srun --nodes=2 --ntasks=2 --overlap (and --exclude for the dropped nodes)
    assert "STO_SPARES=1 STO_STEP_NODES=2 STO_STEP_NTASKS=2\n" in script
    per_rank = script_of(SPARE + ["cluster.gpu_binding=task"])  # one task a rank: 2 a node
    assert "STO_STEP_NTASKS=4\n" in per_rank and sbatch_flags(per_rank)["--ntasks-per-node"] == "2"
    assert "(cluster.spare_nodes=1)" in script
    plain = script_of(["+cluster=localslurm", "cluster.nodes=2"])  # K=0: no trace of spares
    assert "--no-kill" not in sbatch_flags(plain) and sbatch_flags(plain)["--nodes"] == "2"
    assert "STO_SPARES=0\n" in plain and "STO_STEP_" not in plain and "--overlap" not in plain
    assert submitit_adapter.step_loop(3, "py") == submitit_adapter.step_loop(3, "py", 0, 2, 8)


def test_gpu_binding_task_asks_a_task_count_with_the_spares():
    flags = sbatch_flags(script_of(["+cluster=h100x8", "cluster.nodes=2", "cluster.spare_nodes=1",
                                    "cluster.gpu_binding=task", "+model=llama3_8b", "+strategy=ddp"]))
    assert flags["--nodes"] == "3" and flags["--ntasks"] == "24"


def test_the_dry_run_names_the_spares():
    line = resources_line(compose_run(SPARE))
    assert "nodes: 3 = 2 training + 1 spare (cluster.spare_nodes=1: sbatch --nodes=3 --no-kill, srun --nodes=2)" in line
    assert "spare" not in resources_line(compose_run(["+cluster=localslurm"]))


@pytest.mark.parametrize("overrides,message", [
    (["cluster.spare_nodes=-1", "+cluster=localslurm"], "cluster.spare_nodes=-1 must be >= 0"),
    (["cluster.spare_nodes=1"], "cluster.spare_nodes=1 with cluster.backend=local"),
    (SPARE + ["cluster.in_job_restarts=0"], "cluster.spare_nodes=1 with cluster.in_job_restarts=0"),
])
def test_spares_that_make_no_sense_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as exc:
        validate(compose_run(overrides))
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_blamed_node_is_restarted_without_while_spares_cover_it():
    names = lambda hosts: hosts  # noqa: E731 - Slurm's names as the hosts
    info = {"failure": "node_failure", "suspect_nodes": ["node2"]}
    assert dropped_nodes(info, [], "41", 1, names) == (["node2"], ["node2"])
    assert dropped_nodes(info, [], "41", 0, names) is None  # no spares: today's requeue
    assert dropped_nodes({"failure": "rank_failure", "suspect_nodes": ["node2"]}, [], "41", 1, names) is None
    earlier = [{"job_id": "41", "dropped_nodes": ["node1"]}]
    assert dropped_nodes(info, earlier, "41", 1, names) is None  # the one spare is used up
    assert dropped_nodes(info, earlier, "41", 2, names) == (["node2"], ["node1", "node2"])
    assert dropped_nodes(info, [{"job_id": "40", "dropped_nodes": ["node1"]}], "41", 1, names) == (
        ["node2"], ["node2"])  # an earlier job's spares were its own
    assert restart_refusal([], "node_failure", "RuntimeError: reset", 7, "41", 3, True, spare=True) is None
    assert "not restarted inside the job" in restart_refusal([], "node_failure", "RuntimeError: reset", 7, "41", 3,
                                                             True)


@pytest.fixture
def no_slurm(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_dead_node_asks_a_restart_on_the_spare_and_records_it(tmp_path, no_slurm):
    """Rank 0 found its peer's node dead (node_failure, node2 blamed): with a spare, an
    in-job restart without node2 (its entry, excluded_nodes, the config's exclude for a
    later resume, RESTART's exclude= line for the step loop); a second dead node, with
    the spare used up, is not restarted inside the job (today's requeue takes it)."""
    (tmp_path / CONFIG).write_text(to_yaml(compose_run(SPARE)))
    log = logging.getLogger("test_hot_spares")
    for segment, node in ((0, "node2"), (1, "node3")):
        started_segment(tmp_path, segment)
        (tmp_path / RESTART).unlink(missing_ok=True)
        # what record_failure leaves once the heartbeats blamed the node
        update_run_json(tmp_path, status="failed", error=f"RuntimeError: [gloo] reset at segment {segment}",
                        failure="node_failure", suspect_nodes=[node], dead_ranks=[2, 3], dead_hosts=[node])
        Restart(tmp_path, 3, identity(0, restart=segment), segment, Beats(12)).ask(log.error)  # spares: config.yaml
        info = read_run_json(tmp_path)
        if segment == 0:
            assert info["status"] == "restarting" and info["in_job_restart"].endswith("without node2 (a spare in "
                                                                                     "its place)")
            [entry] = info["in_job_restarts"]
            assert entry["dropped_nodes"] == ["node2"] and entry["spares_left"] == 0 and entry["rank"] == 2
            assert info["excluded_nodes"] == ["node2"]
            assert (tmp_path / RESTART).read_text().splitlines()[-1] == "exclude=node2"
            assert to_run_config(tmp_path / CONFIG).cluster.exclude == "node2"
    assert len(info["in_job_restarts"]) == 1 and not (tmp_path / RESTART).exists()
    assert info["status"] == "failed" and info["in_job_restart"] == (
        "not restarted: failure node_failure is not restarted inside the job")


# The first step's tasks ask a restart without node2 and the step then waits (as srun does
# for a dead node's tasks); the next one ends at once.
FAKE_SRUN = stuck_srun('{"step": 7}\\nexclude=node2\\n')


def test_per_rank_tasks_the_step_loop_ends_a_step_that_waits_for_a_dead_node_and_excludes_it(tmp_path):
    """One srun task a rank (cluster.gpu_binding=task): the loop ends the old srun and starts
    the next on the training nodes left."""
    cfg = compose_run(SPARE + ["cluster.gpu_binding=task"])
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    script = render_script(cfg, build_layout(cfg), run_dir, python="python", wrapper="/w.sh")
    proc = run_step_loop(tmp_path, script, FAKE_SRUN, {"MARK": str(run_dir / RESTART)},
                         squeue=CLIENT + "printf '41.batch\\n41.0\\n'\n", timeout=50)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 2 and calls[0].startswith("0 --nodes=2 --ntasks=4 --overlap --unbuffered"), calls
    assert calls[1].startswith("1 --nodes=2 --ntasks=4 --overlap --exclude=node2 --unbuffered"), calls
    assert "ending step 0 of job 41" in proc.stderr and "restart 1 of 3 inside job 41" in proc.stderr
    slurm_calls = Path(f"{tmp_path / 'calls'}.slurm").read_text()
    assert "squeue -h -s -j 41 -o %i" in slurm_calls


def _agents_srun(marks: str) -> str:
    """srun for node agents with a spare: its first step's agents ask a restart without node2,
    then (the spare in node2's place) write ``marks`` in RUN_DIR/.agents and wait, as srun
    waits for the dead node's task; the next step ends at once with status 3."""
    return f"""#!/bin/bash
echo "${{STO_IN_JOB_RESTART:-unset}} places=${{STO_AGENT_PLACES:-unset}} $*" >> "$CALLS"
if [ "$(wc -l < "$CALLS")" -eq 1 ]; then
  printf '{{"step": 7, "srun": 0}}\\nexclude=node2\\n' > "$MARK"
  mkdir -p "$RUN/.agents" && cd "$RUN/.agents" && touch node1.up node2.up node3.up
  sleep 2; touch "$RUN/.RESTART.start1"; {marks}
  exec sleep 60
fi
exit 3
"""


@pytest.mark.parametrize("end", ["0", "1"])
def test_node_agents_restart_on_the_spare_and_the_loop_ends_the_srun_left_on_a_dead_node(tmp_path, end):
    """Node agents: one srun holds every node of the job's with --no-kill, the spare's agent
    warm (train/harness/agent_places.py); a restart without node2 is theirs, and once every
    agent off node2 has ended the loop ends the srun (which waits for node2 until Slurm
    declares it DOWN) with the agents' own status: done (0), or another restart (1)."""
    cfg = compose_run(SPARE)
    run_dir = tmp_path / "run dir"
    (run_dir / "slurm").mkdir(parents=True)
    script = render_script(cfg, build_layout(cfg), run_dir, python="python", wrapper="/w.sh")
    marks = f"echo {end} > node1.end; echo 0 > node3.end"
    if end == "1":  # start 1 failed too (RESTART of start 1, still without node2)
        marks += '; printf \'{"step": 9, "srun": 1}\\nexclude=node2\\n\' > "$MARK"'
    proc = run_step_loop(tmp_path, script, _agents_srun(marks), {"MARK": str(run_dir / RESTART), "RUN": str(run_dir)},
                         squeue=CLIENT + "printf '41.batch\\n41.0\\n'\n", timeout=50)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("0 places=2 --nodes=3 --ntasks=3 --overlap --no-kill --unbuffered"), calls
    assert "the step restarts without node2: spares' agents take the places, warm" in proc.stderr, proc.stderr
    assert "every agent has ended but on node2 (dropped): ending step 0 of job 41" in proc.stderr, proc.stderr
    if end == "0":  # the run ended well on node1 and the spare
        assert proc.returncode == 0 and len(calls) == 1, (proc.stderr, calls)
        return
    # node1's agent ended with status 1 after its start 1 asked a restart: start 2 on the nodes left
    assert len(calls) == 2 and calls[1].startswith("2 places=2 --nodes=2 --ntasks=2 --overlap --no-kill --exclude=node2"), calls
    assert proc.returncode == 3, proc.stderr
