"""Property-based checks of the layout rules and of bad input (hypothesis).

Every layout either builds with the invariants the mesh relies on, or is refused with
one ConfigError line naming a field; through the CLI, a refused config submits nothing.
Hostile strings (quotes, ``$()``, backticks, ``;``, newlines, unicode) in the fields that
reach the sbatch script are either refused with one line, or reach bash and sbatch's own
``#SBATCH`` parser exactly as configured.
"""
from __future__ import annotations

import dataclasses
import subprocess
import tempfile
import typing
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import launcher
from launcher.resources import task_shape
from launcher.submit import render_script
from spec.config import ConfigError, RunConfig
from spec.validate import validate
from spec.layout import build_layout

degree = st.sampled_from([-1, 1, 2, 3, 4, 8, 16, 0, -2])


def make(nodes, gpn, pp, rep, shard, tp, engine, zero):
    cfg = RunConfig()
    cfg.cluster.nodes, cfg.cluster.gpus_per_node = nodes, gpn
    s = cfg.strategy
    s.pipeline_parallel, s.dp_replicate, s.dp_shard, s.tensor_parallel = pp, rep, shard, tp
    s.engine, s.zero_stage = engine, zero
    s.data_parallel = "fsdp" if shard != 1 else "ddp"
    cfg.model.n_layers, cfg.model.n_heads, cfg.model.dim = 16, 16, 256
    return cfg


@settings(max_examples=400, deadline=None)
@given(nodes=st.integers(-1, 8), gpn=st.sampled_from([1, 2, 4, 8]), pp=degree, rep=degree, shard=degree,
       tp=degree, engine=st.sampled_from(["torch", "deepspeed"]), zero=st.integers(0, 3))
def test_every_layout_is_valid_or_refused_with_one_line(nodes, gpn, pp, rep, shard, tp, engine, zero):
    cfg = make(nodes, gpn, pp, rep, shard, tp, engine, zero)
    try:
        layout = build_layout(cfg)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and "=" in message  # names a field and its value
        return
    assert layout.pp * layout.dp_replicate * layout.dp_shard * layout.tp == nodes * gpn
    assert gpn % layout.tp == 0
    for rank in range(layout.world_size):  # every TP group inside one node
        node, _ = layout.placement(rank)
        group_start = rank - layout.coords(rank)["tp"]
        assert layout.placement(group_start)[0] == node
    assert not (engine == "deepspeed" and layout.pp > 1 and zero > 1)


@settings(max_examples=200, deadline=None)
@given(steps=st.integers(-3, 3), mb=st.integers(-2, 2), seq=st.integers(-1, 600),
       precision=st.sampled_from(["auto", "fp32", "bf16", "fp8", ""]))
def test_field_values_are_valid_or_refused(steps, mb, seq, precision):
    cfg = RunConfig()
    cfg.train.steps, cfg.train.micro_batch_size, cfg.train.seq_len = steps, mb, seq
    cfg.strategy.mixed_precision = precision
    ok = steps >= 1 and mb >= 1 and 1 <= seq <= cfg.model.max_seq_len and precision in ("auto", "fp32", "bf16")
    try:
        validate(cfg)
    except ConfigError as exc:
        assert not ok and "\n" not in str(exc)
        return
    assert ok


@pytest.mark.slurm
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.sampled_from(["cluster.nodes=0", "strategy.tensor_parallel=3", "strategy.dp_replicate=5",
                            "train.seq_len=100000", "strategy.mixed_precision=fp8", "train.steps=-1",
                            "strategy.pipeline_parallel=0", "cluster.gpus_per_node=0"]))
def test_refused_configs_submit_nothing(tmp_path, slurm_cluster, bad):
    name = f"refused-{uuid.uuid4().hex[:12]}"  # other tests may submit meanwhile: look for ours only
    proc = launcher(["+cluster=localslurm", bad, f"launcher.job_name={name}"], cwd=tmp_path, env=slurm_cluster,
                    timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "submitted job" not in proc.stdout
    queued = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], env=slurm_cluster, capture_output=True,
                            text=True).stdout.split()
    accounted = subprocess.run(["sacct", "-X", "-n", "--name", name, "-o", "JobID", "-S", "now-300seconds"],
                               env=slurm_cluster, capture_output=True, text=True).stdout.split()
    assert queued == [] and accounted == []


# --- hostile strings -------------------------------------------------------------------

# Pieces hostile to a shell, to sbatch's #SBATCH parser or to a line-based format.
_PIECES = ["a", "Z", "9", " ", "  ", "'", '"', "$", "$(touch x)", "`touch y`", "${HOME}", ";", "&&", "|", ">", "<",
           "*", "?", "!", "#", "~", "%", "%j", "\\", "\n", "\r", "\t", "\x00", "\x1b", "\x85", "\u2028", "é", "日本",
           "\u200b", "🚀", "-", "--", "=", ",", "[1-2]", "/", ".."]
hostile = st.one_of(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=8).map("".join),
                    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=6))

# What validate refuses, per kind of field (spec/validate.py).
_CONTROL = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]}
_REFUSED = {"sbatch": _CONTROL | {"\\"}, "env": _CONTROL, "run_dir": _CONTROL | {"\\", "%"}}
_MARK = "\x01"  # never in an accepted value: separates the records the bash run prints


def _slurm_words(text: str) -> typing.List[str]:
    """The words sbatch reads from the rest of an ``#SBATCH`` line: a model of its parser
    (Slurm's src/sbatch/opt.c, ``_get_argument``): ' and " group, a backslash escapes the
    next character even inside quotes, an unquoted # starts a comment."""
    words, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return words
        word, quote, escape = [], None, False
        while i < len(text) and (quote or not text[i].isspace()):
            ch, i = text[i], i + 1
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
                continue
            elif quote:
                if ch == quote:
                    quote = None
                    continue
            elif ch in "'\"":
                quote = ch
                continue
            elif ch == "#":
                return words + (["".join(word)] if word else [])
            word.append(ch)
        assert quote is None, f"sbatch: unmatched {quote} in {text!r}"
        words.append("".join(word))


def _run_script(script: str, tail: str = "") -> typing.Dict[str, typing.List[str]]:
    """Run the rendered script with bash, `srun` stood in for by an executable that prints
    its words (nothing starts; an executable, not a function: the script's step loop of
    restarts inside the job calls `command srun`), then ``tail``; also hand each
    ``#SBATCH`` line's rest to bash as arguments. Returns the words bash saw: {"srun":
    [...], "#SBATCH --flag": [...], "tail": [...]}. Fails if anything ran that should not
    have (a file appeared in the working directory)."""
    mark = f"printf '%s\\0' {_MARK}"
    # `exit` shadowed: the script's teardown ends with it, and the checks below must run.
    lines = ["exit() { :; }", script]
    lines += [f"{mark}{line[len('#SBATCH '):].split('=')[0]} {line[len('#SBATCH '):]}"
              for line in script.splitlines() if line.startswith("#SBATCH ")]
    lines.append(f"{mark}tail {tail}")
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as bin_dir:
        (Path(bin_dir) / "srun").write_text(f"#!/bin/bash\n{mark}srun \"$@\"\n")
        (Path(bin_dir) / "srun").chmod(0o700)
        proc = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=cwd, capture_output=True,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
        assert proc.returncode == 0 and not proc.stderr, proc.stderr.decode(errors="replace")
        assert not list(Path(cwd).iterdir()), "the script ran something it should only have quoted"
    records = proc.stdout.decode().split(_MARK)[1:]
    return {words[0]: words[1:] for words in (r.rstrip("\0").split("\0") for r in records)}


def _sbatch_flag(script: str, flag: str) -> str:
    """The value sbatch's own parser reads for ``--flag`` (exactly one such line)."""
    found = [line for line in script.splitlines() if line.startswith(f"#SBATCH {flag}=")]
    assert len(found) == 1, found
    words = _slurm_words(found[0][len("#SBATCH "):])
    assert len(words) == 1 and words[0].startswith(f"{flag}="), words
    return words[0][len(flag) + 1:]


def _refused(cfg: RunConfig, field: str, kind: str, value: str) -> bool:
    """validate(cfg): True if it refused (for the right reason, in one line naming the field)."""
    try:
        validate(cfg)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and field in message, message
        assert set(value) & _REFUSED[kind], f"refused a value without a forbidden character: {message}"
        return True
    assert not set(value) & _REFUSED[kind], f"accepted {value!r}"
    return False


def _slurm_cfg() -> RunConfig:
    cfg = RunConfig()
    cfg.cluster.backend, cfg.cluster.accelerator, cfg.cluster.partition = "slurm", "gpu", "gpu"
    return cfg


_SLOW = settings(max_examples=50, deadline=None)
_RUN_DIR = Path("/scratch/runs")


@pytest.mark.parametrize("key,flag", [("launcher.job_name", "--job-name"), ("cluster.partition", "--partition")])
@_SLOW
@given(value=hostile)
@example("a b;$(touch pwned2)").via("the e2e test's job name")
@example("x\n#SBATCH --qos=evil").via("an injected directive")
def test_hostile_sbatch_value_is_refused_or_reaches_sbatch_exactly(key, flag, value):
    cfg = _slurm_cfg()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    if _refused(cfg, key, "sbatch", value):
        return
    script = render_script(cfg, build_layout(cfg), _RUN_DIR / "r")
    assert _sbatch_flag(script, flag) == value  # as sbatch reads it
    assert _run_script(script)[flag] == [f"{flag}={value}"]  # as bash reads it


@_SLOW
@given(value=hostile)
@example("it's a \"q\" $(touch pwned); x").via("the e2e test's run directory")
@example("50%j").via("a Slurm filename pattern")
def test_hostile_run_dir_is_refused_or_reaches_the_job_exactly(value):
    run_dir = _RUN_DIR / f"r{value}"
    cfg = _slurm_cfg()
    cfg.launcher.run_dir = str(run_dir)
    if _refused(cfg, "launcher.run_dir", "run_dir", str(run_dir)):
        return
    script = render_script(cfg, build_layout(cfg), run_dir, python="python", wrapper="/opt/sto/task_wrapper.sh")
    folder = f"{run_dir}/slurm"
    assert _sbatch_flag(script, "--output") == f"{folder}/%j_0_log.out"
    assert _sbatch_flag(script, "--error") == f"{folder}/%j_0_log.err"
    words = _run_script(script)
    assert words["srun"] == ["--unbuffered", "--output", f"{folder}/%j_%t_log.out", "--error",
                             f"{folder}/%j_%t_log.err", f"--cpus-per-task={task_shape(cfg)[1]}",
                             "--kill-on-bad-exit=1", "/bin/bash",
                             "/opt/sto/task_wrapper.sh", "python", "-u",
                             "-m", "submitit.core._submit", folder]


@_SLOW
@given(value=st.one_of(hostile, st.just("")))
@example("a b; $(rm -rf /) `x` \"y\" 'z' && w").via("shell metacharacters")
def test_hostile_env_value_is_refused_or_exported_exactly(value):
    cfg = _slurm_cfg()
    cfg.cluster.env = {"WEIRD": value, "NCCL_DEBUG": "WARN"}
    if _refused(cfg, "cluster.env.WEIRD", "env", value):
        return
    script = render_script(cfg, build_layout(cfg), _RUN_DIR / "r")
    assert _run_script(script, tail='"$WEIRD" "$NCCL_DEBUG"')["tail"] == [value, "WARN"]


def _string_fields() -> typing.List[str]:
    """Every str / Optional[str] field of the schema (a field added later is covered too)."""
    keys = []
    top = typing.get_type_hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        if not dataclasses.is_dataclass(section.default_factory):  # a top-level field (entrypoint, ...)
            keys += [section.name] if top[section.name] in (str, typing.Optional[str]) else []
            continue
        hints = typing.get_type_hints(section.default_factory)
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(section.default_factory)
                 if hints[f.name] in (str, typing.Optional[str])]
    return keys


@pytest.mark.parametrize("key", _string_fields())
def test_every_string_field_refuses_a_newline(key):
    cfg = RunConfig()
    *section, name = key.split(".")
    setattr(getattr(cfg, section[0]) if section else cfg, name, "ok\n#SBATCH --qos=evil")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}='ok\\n#SBATCH --qos=evil'"), message


def test_setup_lines_are_shell_by_design():
    cfg = RunConfig()
    cfg.cluster.setup = ["module load cuda\nsource 'my env'/bin/activate"]
    validate(cfg)


@pytest.mark.parametrize("key,value,expect", [
    ("cluster.hang_timeout_s", -1, "must be >= 0"),
    ("checkpoint.every_minutes", -1.0, "must be >= 0"),
    ("checkpoint.every_steps", -2, "must be >= 0"),
    ("checkpoint.keep", 0, "must be >= 1"),
    ("cluster.signal_delay_s", -5, "must be >= 0"),
    ("cluster.max_requeues", -1, "must be >= 0"),
    ("optim.lr", -1e-3, "must be >= 0"),  # 0 is accepted (frozen weights, an evaluation run)
    ("optim.lr", float("nan"), "must be >= 0"),
    ("optim.beta2", 1.0, "must be in [0.0, 1.0)"),
    ("optim.grad_clip", -1.0, "must be >= 0"),
    ("data.num_tokens", 0, "must be >= 1"),
    ("data.seed", -1, "must be >= 0"),
    ("train.gc_every_steps", -1, "must be >= 0"),
    ("fault.raise_at_step", -1, "must be >= 0"),
    ("fault.raise_every_steps", -3, "must be >= 0"),
    ("fault.slow_async_save_s", -0.5, "must be >= 0"),
    ("train.dist_timeout_s", 0, "must be >= 1"),
    ("train.dist_timeout_s", 300, "must be at most train.dist_timeout_s - 5 = 295"),  # hang 300 s default
    ("cluster.hang_timeout_s", 900, "must be at most train.dist_timeout_s - 5 = 595"),
    ("optim.min_lr_ratio", 1.5, "must be in [0.0, 1.0]"),
    ("model.n_kv_heads", 0, "must be > 0 or null"),
    ("cluster.gpu_mem_gb", -80.0, "must be > 0 or null"),
    ("cluster.mem_gb", -4, "must be >= 0"),
    ("cluster.exclude", "node1;reboot", "is not a Slurm host list"),
    ("cluster.exclude", "node 1", "is not a Slurm host list"),
    ("launcher.job_name", "a\\b", "contains a backslash"),
    ("launcher.run_dir", "runs/100%", "contains '%'"),
    ("launcher.root", "C:\\runs", "contains '\\\\'"),
    ("data.path", "tokens\x00.bin", "contains the control character '\\x00'"),
    ("cluster.env", {"NCCL DEBUG": "1"}, "'NCCL DEBUG', which is not a shell identifier"),
    ("cluster.env", {"1X": "1"}, "'1X', which is not a shell identifier"),
    ("cluster.env", {"X": "1\n2"}, "cluster.env.X='1\\n2' contains the control character"),
])
def test_invalid_fields_are_refused_in_one_line_with_value_and_fix(key, value, expect):
    cfg = RunConfig()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and expect in message, message  # env rows: `expect` names the value
    shown = repr(value) if isinstance(value, str) else "" if isinstance(value, dict) else str(value)
    assert key in message and shown in message and "; " in message, message  # field, value; fix


@pytest.mark.parametrize("hang,dist", [(0, 1), (295, 600), (120, 600), (5, 600)])
def test_hang_watchdog_below_the_collective_timeout_is_accepted(hang, dist):
    cfg = RunConfig()
    cfg.cluster.hang_timeout_s, cfg.train.dist_timeout_s = hang, dist
    validate(cfg)
