"""What Slurm gives each task, on the real local cluster: the CPUs asked on sbatch AND srun
(cluster.cpus_per_task=0 derived from cluster.cpus_per_node) and --mem=0's whole node.

The local cluster runs task/none, so no task is bound to its CPUs here (tests/test_sbatch.py
checks the rendered options); this shows that the srun line with --cpus-per-task starts
the step on 2 nodes, one node agent each with the node's CPUs, and what each rank it forks
is told: what one srun task a rank would be (its share of the CPUs, the step's ranks)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import launcher, run_dir_of, wait_until
from spec.rundir import read_run_json

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPT = """\
import json, os, socket
keys = ("SLURM_CPUS_PER_TASK", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "RANK")
seen = {k: os.environ.get(k) for k in keys}
seen["host"] = socket.gethostname()
with open(os.path.join(os.environ["STO_RUN_DIR"], "resources_rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
"""


def test_cpus_per_task_on_srun_and_the_whole_node_memory(tmp_path, slurm_cluster):
    script = tmp_path / "resources.py"
    script.write_text(SCRIPT)
    # localslurm: cpus_per_node 4 (slurm.conf's CPUs=4) shared by 2 ranks per node: 2 each, 4 the agent.
    proc = launcher(["+cluster=localslurm", "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.cpus_per_task=0",
                     "cluster.mem_gb=0", f"entrypoint={script}", "launcher.wait=true"],
                    cwd=tmp_path, env=slurm_cluster, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    batch = (run_dir / "sbatch.sh").read_text()
    srun = next(line for line in batch.splitlines() if line.startswith("srun "))
    assert "#SBATCH --cpus-per-task=4" in batch and " --cpus-per-task=4 " in srun and "#SBATCH --mem=0" in batch
    assert "#SBATCH --ntasks-per-node=1" in batch and "export STO_AGENT=2" in batch
    assert "--wckey" not in batch
    info = read_run_json(run_dir)
    assert info["status"] == "completed" and info["world_size"] == 4, info
    seen = [json.loads((run_dir / f"resources_rank{r}.json").read_text()) for r in range(4)]
    assert len({s["host"] for s in seen}) == 2 and sorted(s["SLURM_PROCID"] for s in seen) == ["0", "1", "2", "3"]
    assert {s["SLURM_CPUS_PER_TASK"] for s in seen} == {"2"} and {s["SLURM_STEP_NUM_TASKS"] for s in seen} == {"4"}
    node_mb = subprocess.run(["scontrol", "show", "node", seen[0]["host"]], env=slurm_cluster, capture_output=True,
                             text=True).stdout.split("RealMemory=")[1].split()[0]

    def accounted():
        """sacct's job and step rows once the job's record is final: slurmdbd showed a COMPLETED
        job's ReqMem as "16?" for a moment (a fresh-clone suite), as it shows a name "allocation"."""
        rows = subprocess.run(["sacct", "-n", "-P", "-j", info["job_id"], "-o", "JobID,State,ReqMem,NTasks,AllocTRES"],
                              env=slurm_cluster, capture_output=True, text=True).stdout.splitlines()
        found = [next((r.split("|") for r in rows if r.startswith(f"{info['job_id']}{end}|")), None)
                 for end in ("", ".0")]
        return (rows, *found) if None not in found and re.fullmatch(r"\d+[KMGT]", found[0][2]) else None
    rows, job, step = wait_until(accounted, 60, "sacct's final record of the job")
    # --mem=0: all of each node's memory (the job's, over 2 nodes; the local cluster does not make
    # memory consumable, CR_CPU, so tasks get no SLURM_MEM_PER_NODE); the step: 2 agents x 4 CPUs.
    assert job[2] == f"{2 * int(node_mb)}M", rows
    assert step[1] == "COMPLETED" and step[3] == "2" and "cpu=8," in step[4], rows
