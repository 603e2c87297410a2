"""Shared fixtures: run the launcher as a user would, and the real local Slurm cluster."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from warm import pythonpath

# CPU tests hide CUDA from themselves, here, before any test module imports torch (CUDA
# reads the variable when it first initialises), and from every subprocess, spawned rank
# and Slurm job they start (inherited): on a GPU machine the multi-rank tests would go
# NCCL on one device ("Duplicate GPU") and bf16 would replace fp32 in bitwise checks.
# Tests marked `gpu` run only with STO_TEST_GPU=1 (`make test-gpu`), which keeps CUDA
# visible; without it they skip, and with it a machine without CUDA fails them.
GPU_OPT_IN = "STO_TEST_GPU"
GPU_TESTS = os.environ.get(GPU_OPT_IN) == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

REPO = Path(__file__).resolve().parent.parent
# A user's script that logs one step and imports no torch: for Slurm tests of what is not
# training (sweeps, arrays, quoting, status): a job of it costs ~1 CPU-s, a trainer's rank ~8.
ONE_STEP = REPO / "tests" / "fixtures" / "one_step.py"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    if not GPU_TESTS:
        pytest.skip(f"gpu test: runs with {GPU_OPT_IN}=1 on a machine with CUDA (make test-gpu); "
                    "the other tests hide CUDA (CUDA_VISIBLE_DEVICES='')")
    import torch

    if not torch.cuda.is_available():
        pytest.fail(f"{GPU_OPT_IN}=1 but torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
CLUSTER_DIR = Path(os.environ.get("LOCALSLURM_DIR", "/tmp/localslurm"))


def launcher(args: List[str], cwd: Path, env: dict | None = None, timeout: float = 600,
             repo: Path = REPO, cold: bool = False) -> subprocess.CompletedProcess:
    """``python -m launcher ARGS`` from ``cwd`` (runs land in cwd/runs), with ``repo``'s code
    (a clone's: tests/test_frozen_code_slurm.py). With this checkout's code it is forked from
    the warm server (tests/warm.py: the launcher and its local ranks without ~2 s of imports
    each; a Slurm job's tasks start cold on the nodes all the same); ``cold=True``, or
    another ``repo``, starts a fresh interpreter: the tests of the real start-up
    (tests/test_ddp.py, test_cli.py's bad input)."""
    if repo == REPO and not cold:
        import warm

        return warm.launcher(args, cwd, env, timeout)
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": pythonpath(repo)}
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def run_dir_of(output: str) -> Path:
    lines = [line for line in output.splitlines() if line.startswith("run_dir: ")]
    assert lines, f"no run_dir line in output:\n{output}"
    return Path(lines[-1].split(": ", 1)[1])


def wait_until(predicate, timeout: float, what: str):
    """``predicate()``'s first truthy value, polled every 0.3 s; fails after ``timeout`` s."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def submit_run(args: List[str], cwd: Path, env: dict, repo: Path = REPO) -> tuple:
    """``python -m launcher ARGS`` that submits one job: (job id, run directory)."""
    proc = launcher(args, cwd=cwd, env=env, timeout=120, repo=repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = next(line.split()[2] for line in proc.stdout.splitlines() if line.startswith("submitted job"))
    return job, run_dir_of(proc.stdout)


def job_gone(job: str, env: dict) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout
    return not out.strip()


def sacct_states(job: str, env: dict) -> list:
    """Every attempt's state (-D keeps requeued attempts), oldest first."""
    return subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State"], env=env,
                          capture_output=True, text=True).stdout.split()


def final_states(job: str, env: dict) -> list:
    """sacct's states once it records the job's end (the job leaves squeue before its end
    reaches slurmdbd: seen RUNNING there after run.json said completed)."""
    active = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING")
    return wait_until(lambda: (lambda states: states if states and states[-1] not in active else None)(
        sacct_states(job, env)), 60, "accounting to record the end")


def eligible_nodes(env: dict) -> list:
    """The debug partition's nodes this run's jobs may use (those with SBATCH_CONSTRAINT's
    feature when the suite confines the run to a pair)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %f"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return sorted({n for n, f in (line.split() for line in out.splitlines()) if in_this_pair(f, env)})


def in_this_pair(features: str, env: dict) -> bool:
    """Whether a node of these features (sinfo's %f) may run this run's jobs (SBATCH_CONSTRAINT's)."""
    feature = env.get("SBATCH_CONSTRAINT")
    return not feature or feature in features.split(",")


@pytest.fixture(scope="session")
def slurm_cluster() -> dict:
    """The local Slurm cluster of slurm/cluster/up.sh; started here when `make test` has not.

    Returns the environment (with SLURM_CONF) for CLI calls. Fails, never skips: a test
    that needs the cluster must not pass silently without it.
    """
    status = subprocess.run(["bash", str(REPO / "slurm/cluster/status.sh")], capture_output=True, text=True)
    if status.returncode != 0:
        up = subprocess.run(["bash", str(REPO / "slurm/cluster/up.sh")], capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            pytest.fail(f"could not start the local Slurm cluster:\n{up.stdout}\n{up.stderr}")
    conf = CLUSTER_DIR / "etc" / "slurm.conf"
    return dict(os.environ, SLURM_CONF=str(conf))


# A node that Slurm drains as "Kill task failed" (a step's process outlived SIGKILL for
# UnkillableStepTimeout) would leave every later test of its pair pending for nodes until
# their timeouts. On this rig it is the machine's, not the product's: seen once in eight
# fresh-clone suites, on the loaded 2-core VM, after tests/test_in_job_restart_slurm.py's
# step loop killed a step whose peer waited in its rendezvous (the job itself completed).
# After each test that used the cluster, such nodes of its pair return to service, with a
# warning that names them in the test report.
KILL_TASK_FAILED = "Kill task failed"


def return_kill_task_failed_nodes(env: dict) -> List[str]:
    """Resume this run's eligible nodes drained as "Kill task failed"; the nodes resumed."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N|%f|%T|%E"], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    drained = [node for node, features, state, reason in (line.split("|", 3) for line in out.splitlines()
                                                          if line.count("|") >= 3)
               if in_this_pair(features, env) and "drain" in state and reason.startswith(KILL_TASK_FAILED)]
    for node in drained:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=env, capture_output=True,
                       timeout=30)
    return drained


@pytest.fixture(autouse=True)
def _kill_task_failed_nodes_back(request):
    yield
    if "slurm_cluster" in request.fixturenames:
        env = dict(os.environ, SLURM_CONF=str(CLUSTER_DIR / "etc" / "slurm.conf"))
        resumed = return_kill_task_failed_nodes(env)
        if resumed:
            import warnings

            warnings.warn(f"local cluster: {', '.join(resumed)} drained as '{KILL_TASK_FAILED}' during this test; "
                          "returned to service for the next tests")


# --- `--shard K/N`: one of N parts of the selected tests, for tests/run_suite.sh ----------

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only part K (1-based) of N of the selected tests: whole files (their module "
                          "fixtures are built once), balanced on the seconds in tests/durations.json")


def shard_files(weights: dict, n: int) -> List[List[str]]:
    """The files in ``weights`` (file -> seconds) dealt into ``n`` parts: the heaviest first,
    each to the lightest part so far (ties: the lowest part; equal weights: by name), so
    every machine deals them the same way and each file lands in exactly one part."""
    parts: List[List[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for name in sorted(weights, key=lambda f: (-weights[f], f)):
        k = loads.index(min(loads))
        parts[k].append(name)
        loads[k] += weights[name]
    return parts


def shard_select(ids: List[str], k: int, n: int, known: dict) -> List[str]:
    """The test ids of part ``k`` of ``n``: whole files dealt by :func:`shard_files`, each
    file weighed by its tests' seconds in ``known`` (tests/durations.json; a test not
    listed: 10 s, a guess until the list is refreshed)."""
    weights: dict = {}
    for nodeid in ids:
        name = nodeid.split("::", 1)[0]
        weights[name] = weights.get(name, 0.0) + float(known.get(nodeid, 10.0))
    mine = set(shard_files(weights, n)[k - 1])
    return [i for i in ids if i.split("::", 1)[0] in mine]


class _Collected:
    """Every collected test id and its markers, before -m, -k and --shard select
    (tests/test_docs_gpu.py and tests/test_suite_shards.py read them)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        config.sto_collected = {item.nodeid for item in items}
        config.sto_marks = {item.nodeid: {m.name for m in item.iter_markers()} for item in items}


def pytest_configure(config):
    config.pluginmanager.register(_Collected(), "sto-collected")


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected: the weights are of what runs
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        if not 1 <= k <= n:
            raise ValueError(spec)
    except ValueError:
        raise pytest.UsageError(f"--shard={spec}: expected K/N with 1 <= K <= N, e.g. --shard=1/2") from None
    import json

    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    mine = set(shard_select([i.nodeid for i in items], k, n, known))
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in mine])
    items[:] = [i for i in items if i.nodeid in mine]


# --- STO_TEST_CPU=FILE: CPU seconds of each test, appended as JSON lines -------------------
# The suite is CPU-bound on CI's 2 cores, so its budget is CPU, not wall (a loaded machine
# stretches wall, not CPU). Counted: this process, its reaped subprocesses, and the warm
# server with the forks it reaped (tests/warm.py). Not counted: Slurm jobs (sacct has them).

def _cpu_now() -> float:
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        use = resource.getrusage(who)
        total += use.ru_utime + use.ru_stime
    import warm

    server = warm._server
    if server is not None and server.poll() is None:
        try:
            fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        except (OSError, ValueError):
            pass
    return total


def pytest_runtest_call(item):
    if os.environ.get("STO_TEST_CPU"):
        item.sto_tmp_path = (getattr(item, "funcargs", None) or {}).get("tmp_path")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("STO_TEST_CPU")
    if not out:
        yield
        return
    import json
    import time

    cpu, wall = _cpu_now(), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu_s": round(_cpu_now() - cpu, 2), "wall_s": round(time.monotonic() - wall, 2)}
    if getattr(item, "sto_tmp_path", None):  # a Slurm job's WorkDir in sacct: its CPU is the test's
        row["tmp_path"] = str(item.sto_tmp_path)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


FAKE_WORLD = 4096  # the simulated job's ranks (../shared/DESIGN.md: shown at that size in one process)


@pytest.fixture
def fake_world():
    """This process as the last rank of a FAKE_WORLD-rank job on torch's fake process group."""
    import torch.distributed as dist

    from train.torch_compat import fake_process_group

    fake_process_group(FAKE_WORLD - 1, FAKE_WORLD)
    yield FAKE_WORLD
    if dist.is_initialized():
        dist.destroy_process_group()
