"""Each task's device on a GPU cluster: CUDA found or refused
at start, the device by ``cluster.gpu_binding``, DeepSpeed and the checkpoint thread on
the harness's device, users' code told which device is theirs, and the suite's own
CUDA hiding. CUDA is mocked where this machine has none; the tests marked ``gpu`` run
the same choices on a real GPU (``make test-gpu``)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import GPU_TESTS, REPO, launcher, run_dir_of
from warm import pythonpath
from helpers import compose_run
from spec.device import DeviceError, device_index, task_device
from spec.layout import build_layout
from spec.rundir import GPU_BINDING, NO_CUDA, Status, read_run_json, update_run_json
from spec.user_env import task_environment
from train.harness import dist as hdist


# --- the rule: pure -----------------------------------------------------------------------

@pytest.mark.parametrize("binding, local_rank, local_world, count, index", [
    ("node", 3, 8, 8, 3),   # every task sees the node's 8 GPUs: its own by local rank
    ("node", 0, 1, 1, 0),   # one task, one GPU: either binding fits
    ("node", 2, 4, 8, 2),   # more GPUs than tasks: the first ones
    ("task", 3, 8, 1, 0),   # each task sees its own GPU only: cuda:0 whatever its local rank
])
def test_device_index_by_binding(binding, local_rank, local_world, count, index):
    assert device_index(binding, local_rank, local_world, count, "0", "gpu07") == index
    assert task_device("gpu", binding, local_rank) == f"cuda:{index}"


@pytest.mark.parametrize("binding, local_rank, local_world, count, visible, failure, words", [
    ("node", 3, 8, 1, "5", GPU_BINDING,
     ["gpu07", "local rank 3 of 8 sees 1 CUDA device(s)", "CUDA_VISIBLE_DEVICES='5'",
      "the site binds GPUs per task: set cluster.gpu_binding=task"]),
    ("node", 5, 8, 4, None, GPU_BINDING,
     ["gpu07", "sees 4 CUDA device(s) (CUDA_VISIBLE_DEVICES=unset)", "cluster.gpus_per_node<=4"]),
    ("task", 1, 8, 8, "0,1,2,3,4,5,6,7", GPU_BINDING,
     ["gpu07", "exactly 1 GPU", "sees 8 CUDA device(s)", "set cluster.gpu_binding=node"]),
    ("node", 0, 8, 0, "", NO_CUDA, ["gpu07", "no CUDA device", "CUDA_VISIBLE_DEVICES=''", "cluster.accelerator=cpu"]),
])
def test_a_mismatch_is_refused_in_one_line_never_shared(binding, local_rank, local_world, count, visible, failure,
                                                        words):
    """The old choice, local_rank % device_count, put local rank 3 of 8 on the one visible GPU."""
    with pytest.raises(DeviceError) as info:
        device_index(binding, local_rank, local_world, count, visible, "gpu07")
    line = str(info.value)
    assert info.value.failure == failure and "\n" not in line
    assert all(w in line for w in words), line


def test_a_cpu_profile_takes_the_cpu_and_a_bad_binding_is_named():
    assert task_device("cpu", "node", 3) == task_device("cpu", "task", 3) == "cpu"
    with pytest.raises(ValueError, match="cluster.gpu_binding='socket': expected one of node, task"):
        task_device("gpu", "socket", 0)


# --- the harness: init_distributed with CUDA mocked -----------------------------------------

class FakeCuda:
    """torch.cuda's device calls, per thread as CUDA keeps them (a new thread is on 0)."""

    def __init__(self, count: int) -> None:
        self.count, self.local, self.set_calls = count, threading.local(), []

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, device) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        self.local.device = index
        self.set_calls.append((threading.current_thread().name, index))

    def install(self, monkeypatch) -> "FakeCuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: bool(self.set_calls))
        return self


@pytest.fixture
def rank3_of_4(monkeypatch):
    """This process as local rank 3 of a node's 4 tasks (torchrun's variables)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def joined(monkeypatch):
    """init_process_group's calls, recorded instead of made (no rendezvous)."""
    calls = []
    monkeypatch.setattr(hdist.dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    return calls


def test_node_binding_refuses_one_visible_gpu_for_local_rank_3_before_any_collective(monkeypatch, rank3_of_4,
                                                                                     joined):
    cuda = FakeCuda(1).install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(DeviceError, match="set cluster.gpu_binding=task") as info:
        hdist.init_distributed(60, accelerator="gpu", gpu_binding="node")
    assert info.value.failure == GPU_BINDING and "CUDA_VISIBLE_DEVICES='2'" in str(info.value)
    assert joined == [] and cuda.set_calls == []


@pytest.mark.parametrize("binding, count, index", [("task", 1, 0), ("node", 4, 3)])
def test_the_binding_picks_the_device_nccl_joins_on(monkeypatch, rank3_of_4, joined, binding, count, index):
    cuda = FakeCuda(count).install(monkeypatch)
    ctx = hdist.init_distributed(60, accelerator="gpu", gpu_binding=binding)
    assert ctx.device == torch.device("cuda", index) and ctx.backend == "nccl"
    assert cuda.set_calls == [("MainThread", index)]
    (args, kwargs), = joined
    assert args == ("nccl",) and kwargs["device_id"] == torch.device("cuda", index)


def test_a_gpu_profile_without_cuda_raises_the_no_cuda_line_before_init_process_group(rank3_of_4, joined):
    """This machine's torch is a CPU build: the old code trained on gloo."""
    with pytest.raises(DeviceError) as info:
        hdist.init_distributed(60, accelerator="gpu", gpu_binding="node")
    line = str(info.value)
    assert info.value.failure == NO_CUDA and joined == []
    for words in (f"no usable CUDA on {os.uname().nodename}", f"torch {torch.__version__}",
                  "is_available() is False", "device_count 0", "Torch not compiled with CUDA enabled",
                  "CUDA_VISIBLE_DEVICES=''"):
        assert words in line, line


def test_the_no_cuda_line_carries_what_a_cuda_build_said(monkeypatch, rank3_of_4, joined):
    """A CUDA build that finds no device (a binding that hides the GPUs, an old driver)."""
    def init():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040).\nPlease update")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(DeviceError) as info:
        hdist.init_distributed(60, accelerator="gpu")
    line = str(info.value)
    assert "(CUDA 12.8)" in line and "driver on your system is too old (found version 11040). Please update" in line
    assert "\n" not in line and joined == []


def test_a_cpu_profile_on_a_gpu_node_runs_gloo_on_the_cpu(monkeypatch, rank3_of_4, joined):
    """What the profile asked for: CPUs (nothing of CUDA is touched, no GPU context made)."""
    cuda = FakeCuda(8).install(monkeypatch)
    ctx = hdist.init_distributed(60, accelerator="cpu", gpu_binding="node")
    assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
    assert cuda.set_calls == [] and joined[0][0] == ("gloo",) and joined[0][1]["device_id"] is None


def test_the_mfu_line_has_no_gpu_peak_for_a_run_on_cpus():
    from train.loop import Meter

    cfg = compose_run(["cluster.accelerator=gpu", "cluster.peak_tflops_bf16=989"])
    assert Meter(cfg, 2, "cpu", 16).peak is None
    on_gpu = Meter(cfg, 2, "cuda", 16)
    assert on_gpu.peak == 989 and on_gpu.n_gpus == 2


# --- run.json: the refusal is recorded as a failure -------------------------------------------

def _run_dir(tmp_path: Path, status: Status = Status.STARTING) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    update_run_json(run_dir, status=status)
    return run_dir


def test_a_refusal_fails_the_run_ends_the_slurm_job_and_no_echo_replaces_it(tmp_path, monkeypatch):
    from train.harness import outcome

    cancelled = []
    monkeypatch.setattr(outcome.preempt, "current_job_id", lambda: "4242")
    monkeypatch.setattr(outcome.preempt, "cancel", lambda run_dir, reason: cancelled.append((run_dir, reason)))
    monkeypatch.setattr(outcome, "requeue_without_suspects", lambda *a: None)
    run_dir, log = _run_dir(tmp_path), logging.getLogger("test.cuda")
    with pytest.raises(SystemExit) as code:
        outcome.refuse_start(DeviceError("no usable CUDA on gpu07 ...", NO_CUDA), run_dir, 1, 4, log)
    info = read_run_json(run_dir)
    assert code.value.code == 1 and info["status"] == Status.FAILED and info["failure"] == NO_CUDA
    assert info["error"] == "DeviceError: no usable CUDA on gpu07 ..."
    # its peers would wait in the rendezvous until dist_timeout_s: the batch script cancels the job
    assert cancelled == [(run_dir, f"a task refused to start ({NO_CUDA})")]
    # rank 0, which had its GPU, sees the rendezvous break: its echo does not replace the cause
    outcome.record_failure(RuntimeError("Connection closed by peer"), run_dir, 0, 4, log, heartbeat_s=0)
    assert read_run_json(run_dir)["failure"] == NO_CUDA


def test_a_finished_run_started_again_stays_finished(tmp_path):
    from train.harness import outcome

    run_dir = _run_dir(tmp_path, Status.COMPLETED)
    with pytest.raises(SystemExit):
        outcome.refuse_start(DeviceError("x", NO_CUDA), run_dir, 0, 1, logging.getLogger("test.cuda"))
    assert read_run_json(run_dir)["status"] == Status.COMPLETED


@pytest.mark.slow
@pytest.mark.parametrize("entry", [None, "script"])
def test_a_local_launch_of_a_gpu_profile_fails_fast_as_no_cuda(tmp_path, entry):
    """End to end on this CPU machine: the built-in trainer and a user's script both stop at
    start with the one line, run.json failed/no_cuda, and the script never runs."""
    script = tmp_path / "mine.py"
    script.write_text("import os, pathlib\npathlib.Path(os.environ['STO_RUN_DIR'], 'ran').write_text('yes')\n")
    args = ["cluster.accelerator=gpu", "train.steps=2"] + ([f"entrypoint={script}"] if entry else [])
    proc = launcher(args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = run_dir_of(proc.stdout)
    info = read_run_json(run_dir)
    assert info["status"] == Status.FAILED and info["failure"] == NO_CUDA, info
    assert "no usable CUDA on" in proc.stdout and "Torch not compiled with CUDA enabled" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr  # the line, not a stack
    assert not (run_dir / "ran").exists() and "backend" not in info  # never joined, never trained


# --- users' code: told its device, and it is the current one --------------------------------

@pytest.mark.parametrize("overrides, rank, device", [
    (["cluster.accelerator=gpu", "cluster.gpus_per_node=4"], 3, "cuda:3"),
    (["cluster.accelerator=gpu", "cluster.gpus_per_node=4", "cluster.gpu_binding=task"], 3, "cuda:0"),
    (["cluster.gpus_per_node=4"], 3, "cpu"),
])
def test_users_code_is_told_its_device_and_the_binding(tmp_path, overrides, rank, device):
    cfg = compose_run(overrides)
    env = task_environment(cfg, build_layout(cfg), tmp_path, rank)
    assert env["STO_DEVICE"] == device and env["STO_GPU_BINDING"] == cfg.cluster.gpu_binding


@contextmanager
def kept_environ():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    """A dry run's directory for a user's script on a 4-GPU profile (config + entrypoint.json)."""
    root = tmp_path_factory.mktemp("user")
    script = root / "where.py"
    script.write_text("import json, os, torch\n"
                      "json.dump({'current': torch.cuda.current_device(), 'told': os.environ['STO_DEVICE']},\n"
                      "          open(os.path.join(os.environ['STO_RUN_DIR'], 'where.json'), 'w'))\n")
    proc = launcher([f"entrypoint={script}", "cluster.accelerator=gpu", "cluster.gpus_per_node=4",
                     "launcher.dry_run=true"], cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir_of(proc.stdout)


@pytest.mark.parametrize("binding, count, index", [("node", 4, 3), ("task", 1, 0)])
def test_the_harness_makes_a_users_device_current_before_the_script_runs(monkeypatch, rank3_of_4, user_run,
                                                                         binding, count, index):
    from spec.config import to_yaml, to_run_config
    from train.harness import user

    cfg = to_run_config(user_run / "config.yaml")
    cfg.cluster.gpu_binding = binding
    (user_run / "config.yaml").write_text(to_yaml(cfg))
    cuda = FakeCuda(count).install(monkeypatch)
    with kept_environ():
        task = user._prepare(user_run)
        assert user._call(task.entry, task.cfg, user_run) == 0
    assert cuda.set_calls == [("MainThread", index)]
    assert json.loads((user_run / "where.json").read_text()) == {"current": index, "told": f"cuda:{index}"}


def test_a_users_task_that_cannot_take_its_gpu_is_refused_before_running(monkeypatch, rank3_of_4, user_run,
                                                                         tmp_path):
    from train.harness import user

    from spec.config import to_yaml, to_run_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "entrypoint.json").write_text((user_run / "entrypoint.json").read_text())
    cfg = to_run_config(user_run / "config.yaml")
    cfg.cluster.gpu_binding = "node"
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    FakeCuda(1).install(monkeypatch)  # binding node, 4 tasks, the site showed each task one GPU
    with kept_environ(), pytest.raises(SystemExit):
        user._prepare(run_dir)
    info = read_run_json(run_dir)
    assert info["status"] == Status.FAILED and info["failure"] == GPU_BINDING
    assert "set cluster.gpu_binding=task" in info["error"] and not (run_dir / "where.json").exists()


# --- DeepSpeed builds on the harness's device ---------------------------------------------------

def test_deepspeed_reads_the_harness_device_from_local_rank_while_it_builds(monkeypatch):
    from train.strategies.deepspeed import local_rank_names_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    with local_rank_names_device(torch.device("cuda", 0)):
        assert os.environ["LOCAL_RANK"] == "0"  # zero.Init and the engine: cuda:0 under binding task
    assert os.environ["LOCAL_RANK"] == "3"
    with local_rank_names_device(torch.device("cpu")):
        assert os.environ["LOCAL_RANK"] == "3"


def test_every_deepspeed_build_sees_the_harness_device(monkeypatch):
    """Under binding task local rank 3 has cuda:0: zero.Init and deepspeed.initialize would
    take cuda:3 from LOCAL_RANK ("invalid device ordinal")."""
    import deepspeed

    from train.harness.dist import DistContext
    from train.strategies import deepspeed as ds_strategy

    cfg = compose_run(["+strategy=zero3", "cluster.gpus_per_node=4", "cluster.accelerator=gpu",
                       "cluster.gpu_binding=task"])
    ctx = DistContext(rank=3, world_size=4, local_rank=3, local_world_size=4, node_rank=0, master_addr="gpu07",
                      master_port=29501, job_id="1", restart_count=0, launcher="srun", hostname="gpu07",
                      backend="nccl", device=torch.device("cuda", 0))
    seen = []

    @contextmanager
    def build(config):
        seen.append(("zero.Init", os.environ["LOCAL_RANK"]))
        yield

    def initialize(**kwargs):
        seen.append(("initialize", os.environ["LOCAL_RANK"]))
        return SimpleNamespace(module=torch.nn.Module(), optimizer=None, zero_optimization_stage=lambda: 3), None, None, None

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(ds_strategy, "partitioned_build", build)
    monkeypatch.setattr(ds_strategy.DeepSpeedBuilder, "shard", lambda self, model: None)
    monkeypatch.setattr(ds_strategy, "build_adamw", lambda *a: None)
    monkeypatch.setattr(deepspeed, "initialize", initialize)
    builder = ds_strategy.DeepSpeedBuilder(cfg, build_layout(cfg), ctx, None)
    with torch.device("meta"):
        parts = builder.wrap(None, lambda model: None)
    builder.finish(parts)
    assert seen == [("zero.Init", "0"), ("initialize", "0")] and os.environ["LOCAL_RANK"] == "3"


# --- the checkpoint thread works on the rank's GPU ---------------------------------------------

def test_the_async_save_thread_copies_on_the_training_threads_gpu(monkeypatch):
    """A new thread's current device is 0: its stream context's exit made a CUDA context
    on GPU 0 for every rank of the node. Fake CUDA tensors (meta) take the GPU path."""
    from train.checkpoint import async_save

    cuda = FakeCuda(4).install(monkeypatch)
    used = []

    class Stream:
        def __init__(self, device):
            used.append(("stream", threading.current_thread().name, cuda.current_device()))

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    @contextmanager
    def on_stream(stream):
        yield
        used.append(("exit", threading.current_thread().name, cuda.current_device()))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **kw: None)
    cuda.set_device(3)  # the training thread, as pick_device left it
    saver = async_save.AsyncSaver()
    saver._group = object()  # no process group here
    saver.prepare()
    try:
        saver._worker.submit(saver._snapshot.take, {"w": torch.empty(4, device="meta")}).result()
    finally:
        saver.close()
    assert used and all(thread.startswith("checkpoint") and device == 3 for _, thread, device in used), used
    assert cuda.set_calls[-1][1] == 3 and cuda.set_calls[-1][0].startswith("checkpoint")


def test_a_cpu_run_leaves_the_checkpoint_threads_device_alone(monkeypatch):
    from train.checkpoint import async_save

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    saver = async_save.AsyncSaver()
    saver._group = object()
    saver.prepare()
    try:
        saver._worker.submit(lambda: None).result()
    finally:
        saver.close()
    assert calls == [] and not torch.cuda.is_initialized()


# --- the suite on a GPU machine ---------------------------------------------------------------

def test_cpu_tests_and_what_they_start_see_no_cuda():
    if GPU_TESTS:
        pytest.skip("STO_TEST_GPU=1 keeps CUDA visible for the gpu tests")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    child = subprocess.run([sys.executable, "-c", "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                            "torch.cuda.device_count())"], capture_output=True, text=True, timeout=120)
    assert child.stdout.split() == ["''", "0"], child.stderr


def _on_gpu(code: str, visible: str | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh process that sees the GPUs ``visible`` (read when CUDA starts;
    None: those this process sees)."""
    env = dict(os.environ, PYTHONPATH=pythonpath(), **({"CUDA_VISIBLE_DEVICES": visible} if visible else {}))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.gpu
def test_gpu_each_binding_on_a_real_device():
    """One visible GPU and local rank 3 of 4: binding task trains there (cuda:0), binding
    node is refused in one line; a world of one joins NCCL on its device."""
    code = ("import json, torch, torch.distributed as dist\n"
            "from train.harness.dist import init_distributed, pick_device, shutdown\n"
            "from spec.device import DeviceError\n"
            "out = {'task': str(pick_device('gpu', 'task', 3, 4))}\n"
            "out['current'] = torch.cuda.current_device()\n"
            "try:\n    pick_device('gpu', 'node', 3, 4)\nexcept DeviceError as e:\n    out['node'] = e.failure\n"
            "ctx = init_distributed(60, accelerator='gpu', gpu_binding='node')\n"
            "x = torch.ones(4, device=ctx.device)\ndist.all_reduce(x)\n"
            "out.update(backend=ctx.backend, device=str(x.device), sum=float(x.sum()))\n"
            "shutdown()\nprint(json.dumps(out))\n")
    proc = _on_gpu(code, "0")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == {"task": "cuda:0", "current": 0, "node": GPU_BINDING, "backend": "nccl", "device": "cuda:0",
                   "sum": 4.0}


@pytest.mark.gpu
def test_gpu_the_checkpoint_thread_is_on_the_ranks_device():
    code = ("import torch\nfrom train.checkpoint.async_save import AsyncSaver\n"
            "last = torch.cuda.device_count() - 1\ntorch.cuda.set_device(last)\n"
            "s = AsyncSaver(); s._group = object(); s.prepare()\n"
            "w = torch.randn(1000, device='cuda')\n"
            "snap = s._worker.submit(s._snapshot.take, {'w': w}).result()\n"
            "on = s._worker.submit(torch.cuda.current_device).result()\n"
            "assert torch.equal(snap['w'], w.cpu()) and snap['w'].is_pinned()\n"
            "print(on, last)\n")
    proc = _on_gpu(code)
    assert proc.returncode == 0, proc.stderr
    on, last = proc.stdout.split()
    assert on == last
