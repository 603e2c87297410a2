"""Users' own code under the harness, on this machine (no Slurm): entry points, the
session API, examples, bad input, Slurm option pass-through and Accelerate's variables.
The same forms on the real cluster: tests/test_user_slurm.py."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm
from conftest import REPO, launcher, run_dir_of
from warm import pythonpath
from helpers import compose_run
from launcher import entrypoint
from launcher.submit import render_script
from launcher.snapshot import PROJECT
from spec.config import ConfigError
from spec.layout import build_layout
from spec.rundir import read_metrics, read_run_json
from spec.user_env import accelerate_env
from spec.validate import validate

EXAMPLES = REPO / "examples"
PLAIN = str(EXAMPLES / "ddp_plain.py")
SESSION = str(EXAMPLES / "session_dcp.py")


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


# --- bad input: one line naming the field, the value and the fix; nothing submitted -----

@pytest.fixture
def user_pkg(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "jobs.py").write_text("def good(cfg):\n    pass\n\ndef two(cfg, other):\n    pass\n\n"
                                 "def none():\n    pass\n\nasync def coro(cfg):\n    pass\n")
    (tmp_path / "script.py").write_text("print('hi')\n")
    return tmp_path


@pytest.mark.parametrize("value, args, message", [
    ("nope.py", [], "entrypoint=nope.py: no such file"),
    ("mypkg", [], "entrypoint=mypkg is a directory; give the script in it"),
    ("nomod.sub:fn", [], "entrypoint=nomod.sub:fn: no module nomod.sub"),
    ("mypkg.jobs:missing", [], "has no top-level function missing; define `def missing(cfg):`"),
    ("mypkg.jobs:two", [], "two must take the config as its one argument"),
    ("mypkg.jobs:none", [], "none must take the config as its one argument"),
    ("mypkg.jobs:coro", [], "coro must take the config as its one argument"),
    ("mypkg.jobs:good", ["--x"], "a function entry point (mypkg.jobs:good) gets the config, not arguments"),
    (None, ["--x"], "entrypoint_args=['--x'] without an entrypoint"),
])
def test_bad_entry_points_are_refused_with_field_value_and_fix(user_pkg, value, args, message):
    cfg = compose_run([])
    cfg.entrypoint, cfg.entrypoint_args = value, args
    with pytest.raises(ConfigError, match=None) as err:
        entrypoint.resolve(cfg, cwd=user_pkg)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_good_entry_points_resolve_without_importing(user_pkg):
    cfg = compose_run(["entrypoint=mypkg.jobs:good"])
    info = entrypoint.resolve(cfg, cwd=user_pkg)
    assert (info["kind"], info["module"], info["function"]) == ("function", "mypkg.jobs", "good")
    assert info["sys_path"] == str(user_pkg.resolve()) and "mypkg" not in sys.modules
    cfg = compose_run(["entrypoint=script.py"])
    info = entrypoint.resolve(cfg, cwd=user_pkg)
    assert info["kind"] == "script" and cfg.entrypoint == str((user_pkg / "script.py").resolve())
    assert len(info["sha256"]) == 64


def test_cli_refuses_a_missing_script_and_submits_nothing(tmp_path):
    proc = launcher(["+cluster=localslurm", "entrypoint=missing/train.py"], cwd=tmp_path)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: entrypoint=missing/train.py: no such file ({tmp_path.resolve()}/missing/train.py); "
                      "give the path of your training script"], proc.stderr
    assert "submitted" not in proc.stdout and not list(tmp_path.rglob("sbatch.sh"))


def test_tensor_parallel_strategy_is_refused_for_a_users_script(tmp_path):
    proc = launcher(["+cluster=localslurm", "+strategy=tp", f"entrypoint={PLAIN}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "strategy.tensor_parallel=2 (strategy=tp) with entrypoint=" in proc.stderr
    assert "data parallel strategies only" in proc.stderr


# --- cluster.sbatch_extra, cluster.srun_args, containers --------------------------------

HOSTILE = {"comment": "it's \"quoted\" $(rm -rf ~) ; x", "mail-type": "END,FAIL", "mail_user": "a b@example.org",
           "exclusive": True, "gres": "gpu:8", "dependency": "afterok:123"}


def test_sbatch_extra_srun_args_and_containers_are_rendered_shell_safe(tmp_path):
    cfg = compose_run(["+cluster=localslurm", "cluster.container_image=nvcr.io/nvidia/pytorch:24.01-py3",
                       "cluster.container_mounts=['/data:/data','/my scratch:/scratch:ro']",
                       "cluster.container_workdir='/work dir'", "cluster.srun_args=['--cpu-bind=cores','--mpi=pmix']"])
    cfg.cluster.sbatch_extra = dict(HOSTILE)
    validate(cfg)
    script = render_script(cfg, build_layout(cfg), tmp_path / "run dir")
    lines = script.splitlines()
    assert "#SBATCH --exclusive" in lines and "#SBATCH --gres=gpu:8" in lines
    assert "#SBATCH --mail-type=END,FAIL" in lines and "#SBATCH --dependency=afterok:123" in lines
    for key, value in (("comment", HOSTILE["comment"]), ("mail-user", "a b@example.org")):
        line = next(line for line in lines if line.startswith(f"#SBATCH --{key}="))
        assert shlex.split(line.split("=", 1)[1]) == [value]  # sbatch's parser takes the quotes off
    srun = shlex.split(next(line for line in lines if line.startswith("srun ")))
    assert srun[srun.index("--cpu-bind=cores"):srun.index("--cpu-bind=cores") + 5] == [
        "--cpu-bind=cores", "--mpi=pmix", "--container-image=nvcr.io/nvidia/pytorch:24.01-py3",
        f"--container-mounts=/data:/data,/my scratch:/scratch:ro,{tmp_path}:{tmp_path},{PROJECT}:{PROJECT}",
        "--container-workdir=/work dir"]  # the run's parent and, unfrozen, the checkout: mounted where they are
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("override, message", [
    ("+cluster.sbatch_extra.time=10", "cluster.sbatch_extra.time=10: the toolkit sets --time itself; use cluster.time_min"),
    ("+cluster.sbatch_extra.ntasks-per-node=4", "sets --ntasks-per-node itself; use cluster.gpus_per_node"),
    ("+cluster.sbatch_extra.output=x.log", "sets --output itself; use launcher.run_dir"),
    ("+cluster.sbatch_extra.requeue=true", "sets --requeue itself; use cluster.max_requeues"),
    ("+cluster.sbatch_extra.signal=USR1@60", "sets --signal itself; use cluster.signal_delay_s"),
    ("+cluster.sbatch_extra.container-image=x", "use cluster.container_image"),
    ("+cluster.sbatch_extra.Gres=gpu:1", "not an sbatch long option name"),
    ("+cluster.sbatch_extra.comment=a\\\\b", "contains a backslash"),
    ("+cluster.sbatch_extra.exclusive=false", "is not an option value"),
    ("cluster.srun_args=['--nodes=2']", "cluster.srun_args[0]='--nodes=2': the toolkit sets --nodes itself"),
    ("cluster.srun_args=[-n4]", "the toolkit sets --ntasks itself"),
    ("cluster.srun_args=['--output=/tmp/x']", "the toolkit sets --output itself"),
    ("cluster.srun_args=[pmix]", "cluster.srun_args[0]='pmix' is not an option"),
    ("cluster.container_mounts=['/a:/a,/b:/b']", "one mount per item"),
])
def test_options_the_toolkit_sets_are_refused(override, message):
    cfg = compose_run(["+cluster=localslurm", override])  # as the CLI composes it (one CLI case: below)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cli_refuses_an_option_the_toolkit_sets_and_submits_nothing(tmp_path):
    proc = launcher(["+cluster=localslurm", "+cluster.sbatch_extra.time=10"], cwd=tmp_path)
    assert proc.returncode == 2 and not list(tmp_path.rglob("sbatch.sh")), proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["error: cluster.sbatch_extra.time=10: the toolkit sets --time itself; "
                                        "use cluster.time_min instead"]


# --- the examples and the entry-point forms, run on this machine ------------------------

def test_plain_example_runs_under_bare_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", PLAIN,
                           "--steps", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 3 loss" in proc.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_script_and_function_entry_points_complete_and_rerun_is_a_no_op(tmp_path):
    proc = launcher([f"entrypoint={PLAIN}", "entrypoint_args=[--steps,4]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    info = read_run_json(run_dir)
    assert (info["status"], info["world_size"], info["entrypoint"]) == ("completed", 2, PLAIN)
    assert sorted(losses(run_dir)) == [1, 2, 3, 4] and "tokens/s:" in proc.stdout
    recorded = json.loads((run_dir / "entrypoint.json").read_text())
    assert recorded["path"] == PLAIN and recorded["git_commit"] and recorded["sha256"]
    again = launcher([f"entrypoint={PLAIN}", "entrypoint_args=[--steps,4]"], cwd=tmp_path)
    assert again.returncode == 0 and "already completed; nothing submitted" in again.stdout

    proc = launcher(["entrypoint=examples.train_fn:train", "+user.steps=3", "cluster.gpus_per_node=3",
                     f"launcher.root={tmp_path}/runs"], cwd=REPO)  # the package is found from the launch directory
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    assert read_run_json(run_dir)["status"] == "completed" and sorted(losses(run_dir)) == [1, 2, 3]
    assert "done: 3 steps on 3 ranks" in proc.stdout


def test_a_failing_script_is_failed_with_its_exit_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    proc = launcher([f"entrypoint={script}"], cwd=tmp_path)
    assert proc.returncode == 1
    info = read_run_json(run_dir_of(proc.stdout))
    assert info["status"] == "failed" and "exited with status 3" in info["error"]


def test_a_rank_that_fails_first_fails_the_run_though_rank_0_was_stopped_for_it(tmp_path):
    """Rank 1 exits 3 while rank 0 still works: the local supervisor stops rank 0 with
    SIGTERM, which rank 0 takes for an interruption; the run is failed all the same, with
    rank 1's status (the race of the test above, made certain)."""
    script = tmp_path / "rank1_fails.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    proc = launcher([f"entrypoint={script}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    info = read_run_json(run_dir_of(proc.stdout))
    # the supervisor's line, or the launcher's when rank 0 outlived the grace period (loaded machine)
    assert info["status"] == "failed" and "exited with status 3" in info["error"], info


def _start(tmp_path: Path, args: list) -> tuple:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *args, f"launcher.run_dir={run_dir}"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": pythonpath()}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, run_dir


def _signal_rank0_after(run_dir: Path, steps: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while len(read_metrics(run_dir)) < steps:
        assert proc.poll() is None and time.time() < deadline, "the run ended before it was signalled"
        time.sleep(0.1)
    rank0 = subprocess.run(["pgrep", "-o", "-f", "--", f"-m train {run_dir}"], capture_output=True, text=True).stdout
    os.kill(int(rank0.split()[0]), signal.SIGUSR2)


@pytest.mark.parametrize("script, api", [(SESSION, True), (PLAIN, False)], ids=["session-api", "plain"])
def test_signalled_script_is_interrupted_and_resumes_to_the_same_loss(tmp_path, script, api):
    args = [f"entrypoint={script}", "entrypoint_args=[--steps,12,--step-delay,0.3]"]
    # the reference and the resume forked warm (tests/warm.py); the signalled run starts cold,
    # as a user's does (its rank 0 is found by its command line)
    reference = warm.launcher([f"entrypoint={script}", "entrypoint_args=[--steps,12]"], cwd=tmp_path)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected = losses(run_dir_of(reference.stdout))
    proc, run_dir = _start(tmp_path, args)
    _signal_rank0_after(run_dir, 7, proc)
    out = proc.communicate(timeout=120)[0]
    info = read_run_json(run_dir)
    assert (info["status"], info["preemptions"]) == ("interrupted", 1), out
    if api:  # the script saved at the step it stopped
        assert f"signalled: saved step {len(read_metrics(run_dir))}" in out
    else:  # the harness left the code at once; the script's own checkpoint is every 5 steps
        assert "the code did not ask" in out
    resumed = warm.launcher(args + [f"launcher.run_dir={run_dir}"], cwd=tmp_path)  # the same command again
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert read_run_json(run_dir)["status"] == "completed"
    final = losses(run_dir)  # steps redone after a resume are logged again: the last value wins
    assert final == expected
    assert (run_dir / "dcp").is_dir() if api else (run_dir / "plain_ckpt.pt").is_file()


# --- the session API outside and inside the harness -------------------------------------

def test_session_api_is_inert_outside_a_run(monkeypatch):
    from train import session

    monkeypatch.delenv("STO_RUN_DIR", raising=False)
    assert session.run_dir is None and session.should_stop() is False and session.restart_count() == 0
    session.log(1, loss=1.0)  # writes nowhere
    session.requeue()


def test_session_log_writes_the_projects_metrics_rows(tmp_path):
    from train import session
    from train.harness.preempt import PreemptionFlag

    session._bind(session._State(tmp_path, 0, 4, 2, PreemptionFlag()))
    try:
        session.log(5, loss=2.5, tokens_per_s=1000.0, peak_mem_bytes=123, custom=7)
        flag = session._state.flag
        assert session.should_stop() is False
        flag.signum = signal.SIGUSR2
        assert session.should_stop() is True and flag.agreed_requeue
    finally:
        session._bind(None)
    (row,) = read_metrics(tmp_path)
    assert (row.step, row.loss, row.tokens_per_s, row.peak_mem_bytes, row.world_size, row.segment) == \
        (5, 2.5, 1000.0, 123, 4, 2)
    assert row["custom"] == 7 and "mfu" in row


# --- Accelerate: what each task gets equals what `accelerate launch` gives ---------------

def _accelerate_launch_env(argv: list) -> dict:
    """The variables Accelerate's own launcher functions set for ``accelerate launch ARGV``."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv + ["train.py"]))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ""  # as launch_command, without a config file
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if os.environ.get(k) != v and k not in ("OMP_NUM_THREADS", "PYTHONPATH")}


@pytest.mark.parametrize("strategy, flags", [
    ("ddp", ["--multi_gpu"]),
    ("fsdp", ["--use_fsdp", "--fsdp_sharding_strategy", "FULL_SHARD", "--fsdp_reshard_after_forward", "FULL_SHARD"]),
    ("fsdp_grad_op", ["--use_fsdp", "--fsdp_sharding_strategy", "SHARD_GRAD_OP",
                      "--fsdp_reshard_after_forward", "SHARD_GRAD_OP"]),
    ("hsdp", ["--use_fsdp", "--fsdp_sharding_strategy", "HYBRID_SHARD", "--fsdp_reshard_after_forward", "HYBRID_SHARD"]),
    ("zero2", ["--use_deepspeed", "--deepspeed_config_file", "{ds}"]),
    ("zero3_offload", ["--use_deepspeed", "--deepspeed_config_file", "{ds}"]),
])
def test_task_environment_equals_accelerate_launchs(tmp_path, strategy, flags):
    cfg = compose_run(["+cluster=a100x8", "cluster.nodes=2", f"+strategy={strategy}", f"entrypoint={PLAIN}"])
    layout = build_layout(cfg)
    ours = accelerate_env(cfg, layout, tmp_path)
    ds = str(tmp_path / "accelerate_ds_config.json")
    argv = ["--num_processes", "16", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "node1",
            "--main_process_port", "29500", "--mixed_precision", "bf16"] + [f.format(ds=ds) for f in flags]
    assert ours == _accelerate_launch_env(argv)


def test_hsdp_without_reshard_is_accelerates_public_hybrid_shard_zero2(tmp_path):
    """Accelerate's launcher writes the public HYBRID_SHARD_ZERO2, not torch's private FSDP1
    enum name _HYBRID_SHARD_ZERO2."""
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    cfg = compose_run(["+cluster=a100x8", "cluster.nodes=2", "+strategy=hsdp", "strategy.reshard_after_forward=false",
                       f"entrypoint={PLAIN}"])
    ours = accelerate_env(cfg, build_layout(cfg), tmp_path)
    assert ours["FSDP_SHARDING_STRATEGY"] == "HYBRID_SHARD_ZERO2" in FSDP_SHARDING_STRATEGY
    argv = ["--num_processes", "16", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "node1",
            "--main_process_port", "29500", "--mixed_precision", "bf16", "--use_fsdp", "--fsdp_sharding_strategy",
            "HYBRID_SHARD_ZERO2", "--fsdp_reshard_after_forward", "HYBRID_SHARD_ZERO2"]
    assert ours == _accelerate_launch_env(argv)


def test_accelerate_deepspeed_json_carries_the_strategy(tmp_path):
    proc = launcher(["+cluster=a100x8", "cluster.nodes=2", "+strategy=zero3_offload", f"entrypoint={PLAIN}",
                     "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = run_dir_of(proc.stdout)
    ds = json.loads((run_dir / "accelerate_ds_config.json").read_text())
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
    assert f"ACCELERATE_DEEPSPEED_CONFIG_FILE={run_dir}/accelerate_ds_config.json" in proc.stdout
    assert "ACCELERATE_USE_DEEPSPEED=true" in proc.stdout and "WORLD_SIZE=16" in proc.stdout


def test_accelerate_script_runs_multi_cpu_with_the_whole_world_on_cpu(tmp_path):
    proc = launcher([f"entrypoint={EXAMPLES / 'accelerate_train.py'}", "+strategy=zero2", "cluster.gpus_per_node=3",
                     "entrypoint_args=[--steps,3]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    seen = [json.loads((run_dir / f"accelerate_rank{r}.json").read_text()) for r in range(3)]
    assert [s["distributed_type"] for s in seen] == ["DistributedType.MULTI_CPU"] * 3
    assert [s["num_processes"] for s in seen] == [3] * 3 and [s["process_index"] for s in seen] == [0, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy, engine", [("zero2", "DistributedType.DEEPSPEED"), ("fsdp", "DistributedType.FSDP")])
def test_accelerate_engine_is_the_strategys_where_cuda_exists(tmp_path, strategy, engine):
    proc = launcher([f"entrypoint={EXAMPLES / 'accelerate_train.py'}", f"+strategy={strategy}",
                     "cluster.accelerator=gpu", "cluster.gpus_per_node=1", "entrypoint_args=[--steps,3]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads((run_dir_of(proc.stdout) / "accelerate_rank0.json").read_text())
    assert seen["distributed_type"] == engine
    assert seen["zero_stage"] == (2 if strategy == "zero2" else None)


# --- users' own config directories -------------------------------------------------------

@pytest.fixture
def team_conf(tmp_path):
    conf = tmp_path / "myteam" / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "cluster" / "ourcluster.yaml").write_text(
        "name: ourcluster\nbackend: slurm\nnodes: 2\ngpus_per_node: 4\naccelerator: gpu\npartition: gpu\n"
        "peak_tflops_bf16: 989\ngpu_mem_gb: 80\n")
    (conf / "experiment" / "bigrun.yaml").write_text("# @package _global_\ntrain:\n  steps: 1234\n")
    return conf


@pytest.mark.parametrize("how", ["--config-dir", "searchpath"])
def test_own_config_directory_adds_clusters_and_groups(tmp_path, team_conf, how):
    where = ["--config-dir", str(team_conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{team_conf}]"]
    proc = launcher([*where, "+cluster=ourcluster", "+experiment=bigrun", "launcher.dry_run=true"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = (run_dir_of(proc.stdout) / "config.yaml").read_text()
    assert "name: ourcluster" in config and "partition: gpu" in config and "steps: 1234" in config
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --gpus-per-node=4" in proc.stdout


def test_own_config_directory_in_a_sweep_and_its_errors(tmp_path, team_conf):
    sweep = launcher(["--config-dir", str(team_conf), "+cluster=ourcluster", "cluster.nodes=1,2",
                      "launcher.dry_run=true", "-m"], cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    assert sweep.stdout.count("dry run: nothing submitted") == 2
    unknown = launcher(["--config-dir", str(team_conf), "+cluster=theirs"], cwd=tmp_path)
    assert unknown.returncode == 2
    assert f"choose one of a100x8, h100x8, h200x8, local, localslurm, ourcluster (files in {REPO}/conf/cluster/, " \
           f"{team_conf}/cluster/)" in unknown.stderr
    missing = launcher(["--config-dir", str(tmp_path / "nope"), "+cluster=ourcluster"], cwd=tmp_path)
    assert missing.returncode == 2 and f"--config-dir {tmp_path / 'nope'}: no such directory" in missing.stderr


# --- torch's teardown of a destroyed group ----------------------------------------------

KEEP = """
import gc, sys
from train.harness.groups import KEPT, keep_destroyed_groups
keep_destroyed_groups()  # before the code imports torch: the wrap waits for its import
assert "torch" not in sys.modules
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
assert getattr(dist.destroy_process_group, "keeps_groups", False)
keep_destroyed_groups()  # once per process
for attempt in range(2):  # a group can be made again after one was destroyed
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}.{attempt}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    pg = c10d._get_default_group()
    dist.destroy_process_group()  # the script's usual end: destroy, then its DDP model goes
    del model
    gc.collect()
    assert not dist.is_initialized() and any(kept is pg for kept in KEPT), KEPT
print("kept", len(KEPT))
"""


def test_groups_a_users_code_destroys_outlive_its_ddp_model(tmp_path):
    """Under the harness a destroyed process group stays referenced until exit, so DDP's
    Reducer never drops the last reference (its destructor joins gloo's workers with the
    GIL held: a deadlock when a worker still needs it; train/harness/groups.py)."""
    proc = subprocess.run([sys.executable, "-c", KEEP, str(tmp_path / "store")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert proc.returncode == 0 and proc.stdout.strip() == "kept 2", proc.stdout + proc.stderr


# --- a rank that starts after rank 0 ended the run -----------------------------------------

def test_a_rank_slower_than_rank_0_still_runs_its_share():
    """A script without collectives can end on rank 0 (run.json ``completed``) before another
    rank of the same job has read run.json: that rank still runs, and counts the segment rank
    0 counted (seen on the local cluster: ranks 1-3 of a 4-task script said "nothing to do").
    Another job's end (a Slurm restart of a finished run) still stops every rank."""
    from types import SimpleNamespace

    from train.harness.user import _ended_by_this_job

    done = {"status": "completed", "job_id": "42", "restart_count": 0, "segments": 1}
    late = SimpleNamespace(rank=2, job_id="42", restart_count=0)
    assert _ended_by_this_job(done, late) and _ended_by_this_job(done, late, started=True)
    assert _ended_by_this_job(dict(done, status="running"), late, started=True)
    assert not _ended_by_this_job(dict(done, status="interrupted"), late, started=True)  # rank 0 not yet started
    assert not _ended_by_this_job(done, SimpleNamespace(rank=0, job_id="42", restart_count=0))
    assert not _ended_by_this_job(done, SimpleNamespace(rank=2, job_id="42", restart_count=1))  # requeued since
    assert not _ended_by_this_job(done, SimpleNamespace(rank=2, job_id="43", restart_count=0))
    assert not _ended_by_this_job(dict(done, job_id="local"), SimpleNamespace(rank=2, job_id="local", restart_count=0))


def test_a_late_rank_of_a_local_launch_knows_its_launch_ended_the_run(monkeypatch):
    """Every local launch's job id is "local": the local launcher's token (STO_LOCAL_LAUNCH),
    which rank 0 records in run.json, tells a late rank that the end is its own launch's
    (under load rank 1 of a 2-rank script without collectives said "nothing to do"). An
    earlier launch's end, or a rank without the token, still goes by the status alone."""
    from types import SimpleNamespace

    from slurm.env import LOCAL_LAUNCH_ENV
    from train.harness.user import _ended_by_this_job

    done = {"status": "completed", "job_id": "local", "restart_count": 0, "segments": 1, "local_launch": "abc"}
    late = SimpleNamespace(rank=1, job_id="local", restart_count=0)
    monkeypatch.setenv(LOCAL_LAUNCH_ENV, "abc")
    assert _ended_by_this_job(done, late) and _ended_by_this_job(done, late, started=True)
    assert _ended_by_this_job(dict(done, status="running"), late, started=True)
    assert not _ended_by_this_job(dict(done, local_launch="xyz"), late)  # an earlier launch's end
    assert not _ended_by_this_job(done, SimpleNamespace(rank=0, job_id="local", restart_count=0))
    monkeypatch.delenv(LOCAL_LAUNCH_ENV)
    assert not _ended_by_this_job(done, late)
