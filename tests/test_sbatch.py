"""Tier 1: the rendered sbatch script (golden file) and its agreement with submitit."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from launcher.submit import render_script, slurm_parameters
from slurm import submitit_adapter
from helpers import compose_run as _compose
from spec.validate import validate
from spec.layout import build_layout

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = Path("/scratch/runs/demo run")   # a space: every path must be quoted
WRAPPER = "/opt/sto/slurm/task_wrapper.sh"  # where the project lies differs between checkouts
LOOP = "/opt/sto/slurm/step_loop.sh"  # the step loop beside it (a run's frozen copy holds both)


def portable(script: str) -> str:
    """A script rendered without frozen code, with this checkout's step loop named :data:`LOOP`."""
    here = f". {shlex.quote(str(submitit_adapter.STEP_LOOP))} "
    assert script.count(here) == 1, "the script sources the step loop once"
    return script.replace(here, f". {LOOP} ")


def _a100_two_nodes():
    return _compose(["+cluster=a100x8", "cluster.nodes=2", "+model=llama3_8b", "+strategy=ddp",
                     "+cluster.env.NCCL_DEBUG=WARN", "cluster.setup=[module load cuda/12.4]"])


def test_golden_a100x8_two_nodes():
    cfg = _a100_two_nodes()
    script = portable(render_script(cfg, build_layout(cfg), RUN_DIR, python="/opt/venv/bin/python", wrapper=WRAPPER))
    golden = GOLDEN / "a100x8_2nodes.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script  # one agent a node
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --signal=USR2@120" in script


# Spaces, both quotes and a command substitution: each must stay literal in the script.
HOSTILE_RUN_DIR = Path("/scratch/runs/it's a \"quoted\" $(touch x) dir")
HOSTILE_JOB_NAME = "it's a $(touch x); `touch y` && \"z\""


def test_golden_hostile_run_dir_job_name_and_env():
    cfg = _a100_two_nodes()
    cfg.launcher.job_name = HOSTILE_JOB_NAME
    cfg.cluster.env["WEIRD"] = "a 'b' \"c\" $(touch x); `y`"
    validate(cfg)  # accepted: none of it is a control character, a backslash or a %
    script = portable(render_script(cfg, build_layout(cfg), HOSTILE_RUN_DIR, python="/opt/venv/bin/python",
                                    wrapper=WRAPPER))
    golden = GOLDEN / "a100x8_2nodes_hostile.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    folder = f"{HOSTILE_RUN_DIR}/slurm"
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert srun[3] == f"{folder}/%j_%t_log.out" and srun[-1] == folder
    flags = {k: v for k, _, v in (shlex.split(line)[1].partition("=") for line in script.splitlines()
                                  if line.startswith("#SBATCH --") and "=" in line)}
    assert flags["--job-name"] == HOSTILE_JOB_NAME and flags["--output"] == f"{folder}/%j_0_log.out"


def test_env_values_are_quoted():
    cfg = _compose(["+cluster=a100x8", "+cluster.env.WEIRD='a b; $(rm -rf /)'"])
    script = render_script(cfg, build_layout(cfg), RUN_DIR)
    assert "export WEIRD='a b; $(rm -rf /)'" in script


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun on PATH")
def test_dry_run_script_equals_submitits(tmp_path):
    import submitit

    cfg = _a100_two_nodes()
    layout = build_layout(cfg)
    executor = submitit.SlurmExecutor(folder=tmp_path / "slurm", python=submitit_adapter.task_python())
    executor.update_parameters(**slurm_parameters(cfg, layout))
    theirs = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    assert render_script(cfg, layout, tmp_path) == theirs


# What every option of the GPU goldens does, in the words of Slurm 22.05's man pages
# (Debian's slurm-client here, `man sbatch` / `man srun`; the options are unchanged in later
# releases). test_every_rendered_option_is_referenced fails on an option missing here.
MAN = {
    "#SBATCH --cpus-per-task": "sbatch(1) -c: 'ensuing job steps will require ncpus number of processors per task'",
    "#SBATCH --error": "sbatch(1) -e: the batch script's standard error goes to this file pattern",
    "#SBATCH --gpus-per-node": "sbatch(1): 'the number of GPUs required for the job on each node' (binding node: "
                               "srun(1) --gpu-bind, 'By default every spawned task can access every GPU "
                               "allocated to the step')",
    "#SBATCH --gpus-per-task": "sbatch(1): 'the number of GPUs required for the job on each task'; 'requires an "
                               "explicit task count, e.g. -n, --ntasks'; 'will implicitly set "
                               "--gpu-bind=per_task:<gpus_per_task>'",
    "#SBATCH --job-name": "sbatch(1) -J: 'a name for the job allocation'",
    "#SBATCH --mem": "sbatch(1): 'the real memory required per node'; 'A memory size specification of zero is "
                     "treated as a special case and grants the job access to all of the memory on each node'",
    "#SBATCH --nodes": "sbatch(1) -N: 'If only one number is specified, this is used as both the minimum and "
                       "maximum node count'",
    "#SBATCH --ntasks": "sbatch(1) -n: 'job steps run within the allocation will launch a maximum of number tasks' "
                        "(the explicit task count --gpus-per-task requires)",
    "#SBATCH --ntasks-per-node": "sbatch(1): 'Request that ntasks be invoked on each node'; with --ntasks, 'treated "
                                 "as a maximum count of tasks per node'",
    "#SBATCH --open-mode": "sbatch(1): 'Open the output and error files using append or truncate mode' (a requeued "
                           "job appends)",
    "#SBATCH --output": "sbatch(1) -o: the batch script's standard output goes to this file pattern",
    "#SBATCH --partition": "sbatch(1) -p: 'Request a specific partition for the resource allocation'",
    "#SBATCH --requeue": "sbatch(1): 'the batch job should be eligible for requeuing'",
    "#SBATCH --signal": "sbatch(1): 'When a job is within sig_time seconds of its end time, send it the signal "
                        "sig_num' ('may be sent up to 60 seconds earlier')",
    "#SBATCH --time": "sbatch(1) -t: 'a limit on the total run time of the job allocation' (minutes)",
    "srun --unbuffered": "srun(1) -u: the tasks' output is not buffered on its way to the log",
    "srun --output": "srun(1) -o: 'the \"filename pattern\" for stdout redirection' (%t: one file per task)",
    "srun --error": "srun(1) -e: 'how stderr is to be redirected'",
    "srun --cpus-per-task": "srun(1) -c: 'The number of cpus per task specified for salloc or sbatch is not "
                            "automatically inherited by srun and, if desired, must be requested again'",
    "srun --gpus-per-task": "srun(1): one GPU for each task of the step (as sbatch's; 'requires an explicit task "
                            "count': SLURM_NTASKS from sbatch --ntasks)",
    "srun --gpu-bind": "srun(1) --gpu-bind=per_task:1: 'Each task will be bound to the number of gpus specified "
                       "in <gpus_per_task>. Gpus are assigned in order to tasks'",
    "srun --kill-on-bad-exit": "srun(1) -K: 'Controls whether or not to terminate a step if any task exits with a "
                               "non-zero exit code' (=1: terminate; a task killed by a signal exits non-zero)",
    "srun --container-image": "pyxis (srun --help): 'the image to use for the container filesystem'",
    "srun --container-mounts": "pyxis: 'bind mount[s] inside the container', SRC:DST[:FLAGS] separated by ','",
    "srun --container-name": "pyxis: 'name to use for saving and loading the container on the host ... If a "
                             "container with this name already exists, the existing container is used and the "
                             "import is skipped'",
}


def sbatch_flags(script: str) -> dict:
    """``#SBATCH --name[=value]`` lines as {"--name": "value" or ""}."""
    return dict(shlex.split(line)[1].partition("=")[::2] for line in script.splitlines()
                if line.startswith("#SBATCH --"))


def srun_flags(script: str) -> dict:
    """The srun line's options before the command, as {"--name": "value" or ""}."""
    words = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))[1:]
    flags, i = {}, 0
    while words[i].startswith("--"):
        name, eq, value = words[i].partition("=")
        if not eq and name in ("--output", "--error"):  # submitit passes these as two words
            i, value = i + 1, words[i + 1]
        flags[name] = value
        i += 1
    return flags


# (golden file, cluster profile, overrides): every GPU profile, both bindings on h100x8.
GPU_GOLDENS = [
    ("a100x8_2nodes.sbatch", "a100x8", []),
    ("h100x8_2nodes.sbatch", "h100x8", []),
    ("h100x8_2nodes_task.sbatch", "h100x8", ["cluster.gpu_binding=task"]),
    ("h200x8_2nodes.sbatch", "h200x8", []),
    ("h100x8_2nodes_container.sbatch", "h100x8", ["cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3",
                                                  "cluster.container_mounts=['/lustre/data:/data:ro']"]),
]


def _gpu_golden(cluster: str, overrides: list):
    cfg = _compose([f"+cluster={cluster}", "cluster.nodes=2", "+model=llama3_8b", "+strategy=ddp", *overrides])
    validate(cfg)
    return cfg, portable(render_script(cfg, build_layout(cfg), RUN_DIR, python="/opt/venv/bin/python", wrapper=WRAPPER))


@pytest.mark.parametrize("name,cluster,overrides", GPU_GOLDENS[1:-1])  # a100x8's, the container's: their own
def test_golden_gpu_profiles(name, cluster, overrides):
    _, script = _gpu_golden(cluster, overrides)
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()


@pytest.mark.parametrize("name,cluster,overrides", GPU_GOLDENS)
def test_gpu_profile_asks_each_task_its_cpus_memory_and_gpu(name, cluster, overrides):
    """What the golden files hold, option by option: the CPUs of each task on sbatch AND
    srun, within the node's schedulable CPUs (one task a node, the agent with the node's
    CPUs, STO_AGENT = its ranks; or, binding task, a task a GPU with its share); all of each
    node's memory; the binding's GPU options; no submitit wckey (refused where TrackWCKey
    knows no 'submitit')."""
    cfg, _ = _gpu_golden(cluster, overrides)
    c, script = cfg.cluster, (GOLDEN / name).read_text()
    job, step = sbatch_flags(script), srun_flags(script)
    cpus = c.cpus_per_node // c.gpus_per_node  # cpus_per_task 0 in the profile: the node's CPUs shared
    tasks = 1 if c.gpu_binding == "node" else c.gpus_per_node
    assert c.cpus_per_task == 0 and job["--cpus-per-task"] == step["--cpus-per-task"] == str(cpus * 8 // tasks)
    assert int(job["--ntasks-per-node"]) == tasks and tasks * int(job["--cpus-per-task"]) <= c.cpus_per_node
    assert ("export STO_AGENT=8  #" in script) == (tasks == 1) and step["--kill-on-bad-exit"] == "1"
    assert job["--mem"] == "0" and "--wckey" not in job
    if c.gpu_binding == "task":
        assert job["--ntasks"] == str(c.nodes * c.gpus_per_node) and job["--gpus-per-task"] == "1"
        assert step["--gpus-per-task"] == "1" and step["--gpu-bind"] == "per_task:1" and "--gpus-per-node" not in job
    else:
        assert job["--gpus-per-node"] == "8" and "--gpu-bind" not in step and "--gpus-per-task" not in job
        assert "--ntasks" not in job  # task count = nodes x ntasks-per-node
    assert {f"#SBATCH {k}" for k in job} | {f"srun {k}" for k in step} <= set(MAN), "an option without its man page"


def test_cpu_profile_asks_srun_for_the_cpus_too():
    """localslurm (CPU): --cpus-per-task on sbatch and on srun (the node agent's: its 2
    ranks' CPUs), no GPU option, the site's memory."""
    cfg = _compose(["+cluster=localslurm", "cluster.cpus_per_task=2"])
    script = render_script(cfg, build_layout(cfg), RUN_DIR)
    job, step = sbatch_flags(script), srun_flags(script)
    assert job["--cpus-per-task"] == step["--cpus-per-task"] == "4" and job["--ntasks-per-node"] == "1"
    assert not {"--mem", "--wckey", "--gpus-per-node", "--gpus-per-task"} & set(job) and "--gpu-bind" not in step


@pytest.mark.skipif(shutil.which("srun") is None, reason="submitit's SlurmExecutor needs srun on PATH")
@pytest.mark.parametrize("overrides", [["cluster.mem_gb=64"], ["cluster.gpu_binding=task", "cluster.mem_gb=null"]])
def test_submission_equals_dry_run_for_memory_and_binding(tmp_path, overrides):
    """The real submission's script (SlurmExecutor.update_parameters, which passes ``mem``
    through unconverted) equals the dry run's: before, cluster.mem_gb=64 showed --mem=64GB
    in the dry run and submitted --mem=64, megabytes to sbatch."""
    import submitit

    cfg = _compose(["+cluster=h100x8", "cluster.nodes=2", *overrides])
    layout = build_layout(cfg)
    executor = submitit.SlurmExecutor(folder=tmp_path / "slurm", python=submitit_adapter.task_python())
    executor.update_parameters(**slurm_parameters(cfg, layout))
    theirs = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    assert render_script(cfg, layout, tmp_path) == theirs
    assert "--wckey" not in sbatch_flags(theirs)


@pytest.mark.parametrize("overrides,expect", [
    (["+cluster=h100x8", "cluster.nodes=2"],
     "asked per node: one task, the node's agent, forking 8 ranks x 13 CPUs = 104 CPUs of cluster.cpus_per_node=104 "
     "(cluster.cpus_per_task=0: derived; sbatch --ntasks-per-node=1, sbatch and srun --cpus-per-task=104); memory: "
     "all of the node's (cluster.mem_gb=0: --mem=0); GPU binding node: every rank sees the node's 8 GPUs and takes "
     "cuda:LOCAL_RANK (sbatch --gpus-per-node=8)"),
    (["+cluster=h100x8", "cluster.nodes=2", "cluster.gpu_binding=task", "cluster.mem_gb=512"],
     "asked per node: 8 tasks x 13 CPUs = 104 CPUs of cluster.cpus_per_node=104 (cluster.cpus_per_task=0: derived; "
     "sbatch and srun --cpus-per-task=13); memory: 512 GB (--mem=512GB); GPU binding task: each task sees only its "
     "own GPU, cuda:0 (sbatch --ntasks=16 --gpus-per-task=1, srun --gpus-per-task=1 --gpu-bind=per_task:1)"),
    (["+cluster=localslurm"], "asked per node: one task, the node's agent, forking 2 ranks x 1 CPUs = 2 CPUs of "
     "cluster.cpus_per_node=4 (cluster.cpus_per_task=1; sbatch --ntasks-per-node=1, sbatch and srun "
     "--cpus-per-task=2); memory: the site's default (cluster.mem_gb=null: no --mem); GPUs: none "
     "(cluster.accelerator=cpu)"),
])
def test_dry_run_says_what_each_node_is_asked(overrides, expect):
    from launcher.resources import resources_line

    line = resources_line(_compose(overrides))
    assert expect in line and "\n" not in line


def test_conversion_job_takes_the_node_cpus_without_gpus():
    """The CPU job converting a checkpoint before a ZeRO reshape: one node, one task with
    the CPUs of the node's tasks on sbatch and srun, the run's memory, no GPU option of
    either binding, no --ntasks, no requeue."""
    from launcher.submit import conversion_parameters

    cfg = _compose(["+cluster=h100x8", "cluster.nodes=4", "cluster.gpu_binding=task"])
    script = submitit_adapter.render(conversion_parameters(cfg, build_layout(cfg)), RUN_DIR / "slurm")
    job, step = sbatch_flags(script), srun_flags(script)
    assert (job["--nodes"], job["--ntasks-per-node"], job["--cpus-per-task"], job["--mem"]) == ("1", "1", "104", "0")
    assert step["--cpus-per-task"] == "104" and not {"--gpus-per-task", "--gpu-bind"} & set(step)
    assert not {"--gpus-per-node", "--gpus-per-task", "--ntasks", "--requeue", "--wckey"} & set(job)


def test_a_frozen_run_sources_the_step_loop_of_its_copy():
    """The step loop is sourced from the run's frozen code, beside its task wrapper (the
    checkout's only without a copy): a requeued job runs the loop it was submitted with."""
    from launcher.snapshot import PROJECT, Frozen

    copy = Path("/scratch/runs/.code/0123abcd")
    cfg = _a100_two_nodes()
    script = render_script(cfg, build_layout(cfg), RUN_DIR, code=Frozen(((PROJECT, copy),), {}))
    assert f"\n. {copy}/slurm/step_loop.sh || exit 1\n" in script
    assert f"/bin/bash {copy}/slurm/task_wrapper.sh " in script and str(submitit_adapter.STEP_LOOP) not in script
    assert f". {shlex.quote(str(submitit_adapter.STEP_LOOP))} || exit 1" in render_script(cfg, build_layout(cfg),
                                                                                          RUN_DIR)


CONTAINER = Path("/scratch/runs/.code/0123abcd")  # the run's frozen code, beside its run directory


def test_golden_container_job():
    """h100x8 in pyxis's container (the image, a site mount), the run's code frozen: the
    tasks start the image's ``python`` (not the login host's venv) from the frozen copy's
    task wrapper; srun mounts the directory holding the run directory and its .code/
    copy at the same path inside, names the container after the image (restarts and later
    steps reuse it), and kills the step when a task dies (--kill-on-bad-exit=1); the batch
    script's step loop and its helpers run outside the container, on this interpreter."""
    from launcher.snapshot import PROJECT, Frozen

    name, cluster, overrides = GPU_GOLDENS[-1]
    cfg = _compose([f"+cluster={cluster}", "cluster.nodes=2", "+model=llama3_8b", "+strategy=ddp", *overrides])
    validate(cfg)
    script = render_script(cfg, build_layout(cfg), RUN_DIR, python="/opt/venv/bin/python -P",
                           code=Frozen(((PROJECT, CONTAINER),), {}))
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    step = srun_flags(script)
    assert step["--container-mounts"] == "/lustre/data:/data:ro,/scratch/runs:/scratch/runs"
    assert step["--container-name"].startswith("sto-pytorch-25.01-py3-") and step["--kill-on-bad-exit"] == "1"
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert f"/bin/bash {CONTAINER}/slurm/task_wrapper.sh python -u -m submitit.core._submit" in srun
    assert "STO_PYTHON='/opt/venv/bin/python -P'" in script and f"export PYTHONPATH={CONTAINER}" in script


@pytest.mark.parametrize("overrides,tasks,loop", [
    ([], None, None),  # this interpreter: the tasks' and the loop's
    (["cluster.python=/opt/conda/bin/python"], "/opt/conda/bin/python", "/opt/conda/bin/python"),
    (["cluster.container_image=img"], "python", None),  # the image's; the loop on the host
    (["cluster.container_image=img", "cluster.python=python3.12"], "python3.12", None),
])
def test_the_jobs_python_follows_cluster_python_and_the_image(overrides, tasks, loop):
    import sys

    cfg = _compose(["+cluster=localslurm", *overrides])
    validate(cfg)
    script = render_script(cfg, build_layout(cfg), RUN_DIR)
    here = shlex.quote(sys.executable)
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    wrapper = srun.index(str(submitit_adapter.TASK_WRAPPER))
    assert srun[wrapper + 1] == (tasks or sys.executable)
    assert f"STO_PYTHON={shlex.quote(loop or here)}\n" in script


@pytest.mark.parametrize("override,message", [
    ("cluster.python=venv/bin/python", "cluster.python='venv/bin/python' is not an interpreter every task finds"),
    ("cluster.python=' '", "is not an interpreter every task finds alike"),
])
def test_cluster_python_is_refused_when_tasks_would_not_find_it(override, message):
    from spec.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(_compose(["+cluster=localslurm", override]))
    with pytest.raises(ConfigError, match="is the interpreter of a Slurm job's tasks"):
        validate(_compose(["cluster.python=/usr/bin/python3"]))


def test_a_run_directory_that_would_split_the_container_mounts_is_refused():
    from spec.config import ConfigError

    cfg = _compose(["+cluster=localslurm", "cluster.container_image=img"])
    with pytest.raises(ConfigError, match="split pyxis's --container-mounts"):
        render_script(cfg, build_layout(cfg), Path("/scratch/a,b/run"))


def test_an_evaluation_and_a_chains_steps_run_in_the_image_as_the_tasks_do(tmp_path):
    """With cluster.container_image the jobs the toolkit writes itself (an evaluation, a
    chain's export, eval and command) run their command through srun in the image, with
    the run's mounts and container name, on the image's Python; the batch script stays on
    the host (its client, its setup). Without an image: the host's Python, no srun."""
    from launcher import chain, evaljobs

    run_dir = tmp_path / "runs" / "r"
    image = ["+cluster=h100x8", "cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3", "cluster.python=python3"]
    cfg = _compose(image)
    training = slurm_parameters(cfg, build_layout(cfg), run_dir=run_dir)["srun_args"]
    mounts = next(a for a in training if a.startswith("--container-mounts="))
    name = next(a for a in training if a.startswith("--container-name="))
    lines = evaljobs.script(cfg, run_dir, 20, "/host/venv/bin/python").splitlines()
    [job] = [ln for ln in lines if ln.startswith("timeout ")]
    words = shlex.split(job)
    assert words[1:4] == [words[1], "srun", "--ntasks=1"] and "--gpus=1" in words and mounts in words and name in words
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in words
    assert words[words.index("-m") - 1] == "python3" and "/host/venv/bin/python" not in job
    for item in ("export", "eval", "cmd:python my_eval.py {export_dir}"):
        text = chain.script(cfg, item, run_dir, "123", "/host/venv/bin/python", None)
        [line] = [ln for ln in text.splitlines() if ln.startswith("exec ")]
        assert shlex.split(line)[1:3] == ["srun", "--ntasks=1"] and mounts in line and name in line, line
        assert "/host/venv/bin/python" not in line and (item.startswith("cmd") or "python3 -m " in line), line
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert "bash -c 'python my_eval.py " in chain.script(cfg, "cmd:python my_eval.py {export_dir}", run_dir, "1",
                                                          "py", None)
    plain = _compose(["+cluster=h100x8"])
    assert "srun" not in evaljobs.script(plain, run_dir, 20, "/host/venv/bin/python")
    assert "exec /host/venv/bin/python -m launcher.export" in chain.script(plain, "export", run_dir, "1",
                                                                          "/host/venv/bin/python", None)
