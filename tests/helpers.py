"""Helpers shared by tests (importable: pytest puts tests/ on sys.path)."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from launcher.overrides import CONF_DIR
from launcher.provenance import register_resolvers
from spec.config import RunConfig, register_configs, to_run_config

register_configs()
register_resolvers()


def compose_run(overrides: list[str]) -> RunConfig:
    """Compose conf/ like `python -m launcher OVERRIDES` does, as dataclasses."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose("config", overrides=overrides))


def strategy_options() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))


def assert_committed(root) -> None:
    """Every checkpoint under ``root`` verifies, and its manifest names every file in it
    (the ranks' CRC side files are merged into it and gone)."""
    import json
    from pathlib import Path

    from train.checkpoint import MANIFEST, verify

    steps = sorted(Path(root).glob("step_*"))
    assert steps, f"no committed checkpoint under {root}"
    for ckpt in steps:
        assert verify(ckpt) is None, ckpt
        listed = set(json.loads((ckpt / MANIFEST).read_text())["files"])
        on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST}
        assert listed == on_disk, (ckpt, listed ^ on_disk)


def dcp_state(ckpt, out) -> dict:
    """Every leaf of a checkpoint's DCP state (tensors whole, however they were sharded,
    and plain values such as the optimizer's learning rate), by flattened name; loaded
    without ranks through ``out``, a scratch file."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "dcp"), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        else:
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def assert_same_state(ckpt, other, scratch) -> None:
    """Two checkpoints hold the same state: every tensor equal bitwise, every value equal."""
    import torch

    ours, theirs = dcp_state(ckpt, scratch / "a.pt"), dcp_state(other, scratch / "b.pt")
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())[:5]
    assert sum(isinstance(v, torch.Tensor) for v in ours.values()) > 10
    for key, value in ours.items():
        same = torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key]
        assert same, (ckpt, key)


def hidden_slurm_client(directory) -> tuple:
    """(a PATH for a job's tasks, the file of calls): stand-ins for Slurm's client
    (scontrol, squeue, sacct, scancel, sinfo) first on the PATH, which fail as in a
    container image without it, and note every call (none expected: slurm/request.py)."""
    import os
    from pathlib import Path

    stubs = Path(directory) / "no-slurm-client"
    stubs.mkdir(parents=True, exist_ok=True)
    calls = stubs / "calls"
    for name in ("scontrol", "squeue", "sacct", "scancel", "sinfo"):
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\necho "{name}: not in this container" >&2\nexit 1\n')
        stub.chmod(0o755)
    return f"{stubs}:{os.environ['PATH']}", calls


# A stand-in for Slurm's client in a batch script run by bash: notes each call in $CALLS.slurm.
CLIENT = "#!/bin/bash\necho \"$(basename \"$0\") $*\" >> \"$CALLS.slurm\"\n"


def run_step_loop(tmp_path, script: str, srun: str, env: dict, squeue: str = CLIENT, timeout: float = 60):
    """Run a rendered batch ``script`` with bash, ``srun`` (a script's text) and Slurm's
    client stood in for on the PATH (``squeue``: its stand-in's text); ``env`` adds to
    CALLS (tmp_path/calls) and SLURM_JOB_ID=41. The CompletedProcess."""
    import os
    import stat
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", srun), ("scontrol", CLIENT), ("sinfo", CLIENT), ("squeue", squeue),
                       ("scancel", CLIENT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"), "SLURM_JOB_ID": "41", **env}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=timeout)


def stuck_srun(request: str) -> str:
    """A stand-in for srun whose first step writes ``request`` (printf's format) to $MARK
    (RUN_DIR/RESTART: its tasks asked a restart) and never ends by itself (srun waiting
    for a dead node's tasks, a peer waiting in the rendezvous); the next step ends at once.
    Each call's restart index and arguments go to $CALLS."""
    return f"""#!/bin/bash
echo "${{STO_IN_JOB_RESTART:-unset}} $*" >> "$CALLS"
if [ "$(wc -l < "$CALLS")" -eq 1 ]; then
  printf '{request}' > "$MARK"
  exec sleep 60
fi
exit 0
"""


def trained_in_process(tmp_path, function, overrides: list) -> tuple:
    """A one-rank run directory written by the launcher's dry run (``overrides`` on top of a
    16-token sequence and its own data), trained by ``function(rank, run_dir, out)`` in a
    process forked warm (tests/warm.py), as the trainer runs it: (what ``function`` wrote to
    out.json, the run's metrics rows, the run directory)."""
    import json

    import warm
    from conftest import run_dir_of

    prep = warm.launcher([*overrides, "train.seq_len=16", "data.num_tokens=20000", f"data.cache_dir={tmp_path}/d",
                          "cluster.gpus_per_node=1", "launcher.dry_run=true"], cwd=tmp_path)
    assert prep.returncode == 0, prep.stdout + prep.stderr
    run_dir = run_dir_of(prep.stdout)
    proc = warm.call_ranks(function, 1, (str(run_dir), str(tmp_path / "out.json")), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((tmp_path / "out.json").read_text()), rows, run_dir
