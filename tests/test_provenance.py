"""Run directories derive from the overrides that change what a run computes
(launcher/provenance.py): the same command finds the same directory, whatever the order
of its overrides and whatever switches only the launcher or the profiler reads."""
from __future__ import annotations

from launcher.provenance import slug


def test_order_and_plus_do_not_matter():
    assert slug(["train.steps=5", "+cluster=a100x8"]) == slug(["cluster=a100x8", "train.steps=5"])


def test_launcher_switches_and_profiler_are_ignored():
    base = ["train.steps=5", "strategy=fsdp"]
    noise = ["launcher.wait=true", "launcher.max_parallel=2", "profile.steps=[3,4]", "profile.memory=true",
             "launcher.snapshot=false", "launcher.dry_run=true"]
    assert slug(base + noise) == slug(base)
    assert slug(noise) == "default"


def test_what_changes_the_run_changes_the_directory():
    assert slug(["train.steps=5"]) != slug(["train.steps=6"])
    assert slug(["fault.step_delay_s=1"]) != slug([])
