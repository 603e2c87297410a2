"""GPU health from what nvidia-smi and the kernel log really print (train/harness/health.py).

Every fault the preflight and the doctor hold against a node (uncorrected ECC errors,
retired pages pending, a failed or pending row remap, a critical Xid) in every form
nvidia-smi prints it: ``--query-remapped-rows`` in CSV prints 0/1, ``-q`` and
``retired_pages.pending`` print Yes/No, ``--format=csv`` adds a header and units, and a
GPU without a counter prints [N/A] / [Not Supported] / [Unknown Error]. The samples and
where each form comes from: tests/fixtures/nvidia_smi/SOURCES.md.
"""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from train.harness import health

FIX = Path(__file__).parent / "fixtures" / "nvidia_smi"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def h100_with_remap(remap_file: str, parse=None):
    gpus = health.parse_gpu_query(fixture("query_gpu_h100_nounits.csv"), health.GPU_FIELDS)
    remap = (parse or (lambda t: health.parse_gpu_query(t, health.REMAP_FIELDS)))(fixture(remap_file))
    health._join(gpus, remap, health.REMAP_FIELDS[1:])
    return gpus


H100_FAULTS = ["GPU 1: 2 uncorrected ECC errors", "GPU 1: row remapping pending (needs a reset)",
               "GPU 2: row remapping failed"]


@pytest.mark.parametrize("remap_file", ["remapped_rows_nounits.csv", "remapped_rows_header.csv"])
def test_remapped_rows_in_csv_print_0_and_1(remap_file):
    """The old check compared to True: the 1 of a pending or failed remap passed as healthy."""
    gpus = h100_with_remap(remap_file)
    assert [g["remapped_rows.pending"] for g in gpus] == [0, 1, 0, 0]
    assert health.unhealthy_reasons(gpus) == H100_FAULTS


def test_remapped_rows_of_nvidia_smi_q_print_yes_and_no():
    rows = health.parse_remap_q(fixture("q_row_remapper.txt"))
    assert rows == [{"gpu_bus_id": "00000000:18:00.0", "remapped_rows.pending": False, "remapped_rows.failure": False},
                    {"gpu_bus_id": "00000000:2A:00.0", "remapped_rows.pending": True, "remapped_rows.failure": True}]
    gpus = h100_with_remap("q_row_remapper.txt", health.parse_remap_q)
    assert health.unhealthy_reasons(gpus) == ["GPU 1: 2 uncorrected ECC errors", "GPU 1: row remapping failed",
                                              "GPU 1: row remapping pending (needs a reset)"]


def test_remapped_rows_not_supported_is_no_fault():
    gpus = h100_with_remap("remapped_rows_mig.csv")
    assert gpus[0]["remapped_rows.pending"] is None and gpus[1]["remapped_rows.failure"] is None
    assert health.unhealthy_reasons(gpus) == ["GPU 1: 2 uncorrected ECC errors"]


def test_csv_with_header_and_units_is_read_like_nounits():
    """--format=csv: the header line is no GPU (the old parser made it one and then failed
    comparing its text to 0), and "81559 MiB" is a number."""
    with_header = health.parse_gpu_query(fixture("query_gpu_h100_header_units.csv"), health.GPU_FIELDS)
    plain = health.parse_gpu_query(fixture("query_gpu_h100_nounits.csv"), health.GPU_FIELDS)
    assert with_header == plain[:2]
    assert with_header[0]["memory.total"] == 81559 and with_header[0]["ecc.mode.current"] is True
    assert health.unhealthy_reasons(with_header) == ["GPU 1: 2 uncorrected ECC errors"]


def test_retired_pages_pending_yes_is_a_fault():
    gpus = health.parse_gpu_query(fixture("query_gpu_v100_retired_pending.csv"), health.GPU_FIELDS)
    assert [g["retired_pages.pending"] for g in gpus] == [True, False]
    assert gpus[0]["retired_pages.double_bit.count"] == 1
    assert health.unhealthy_reasons(gpus) == ["GPU 0: retired pages pending (needs a reset)"]


def test_counters_a_gpu_does_not_have_are_no_fault():
    gpus = health.parse_gpu_query(fixture("query_gpu_geforce_not_supported.csv"), health.GPU_FIELDS)
    assert len(gpus) == 2 and gpus[1]["ecc.errors.uncorrected.volatile.total"] is None
    assert gpus[1]["ecc.mode.current"] is None and gpus[0]["retired_pages.pending"] is None
    assert health.unhealthy_reasons(gpus) == []


def test_an_error_text_is_no_gpu():
    assert health.parse_gpu_query(fixture("query_gpu_unknown_field.txt"), health.GPU_FIELDS) == []


def test_critical_xids_name_their_gpu():
    gpus = health.parse_gpu_query(fixture("query_gpu_h100_nounits.csv"), health.GPU_FIELDS)
    xids = health.parse_xids(fixture("dmesg_xid.txt"))
    assert xids == {"0000:2a:00": [13, 31, 79], "0000:3a:00": [94], "0000:5d:00": [48]}
    assert health.unhealthy_reasons(gpus, xids) == [
        "GPU 1: 2 uncorrected ECC errors",
        "GPU 1 (PCI 0000:2a:00): Xid 79 in the kernel log",  # 13 and 31: the program's faults
        "GPU 2 (PCI 0000:3a:00): Xid 94 in the kernel log",
        "GPU 3 (PCI 0000:5d:00): Xid 48 in the kernel log"]
    timed = health.parse_xids(fixture("dmesg_T_xid.txt"))  # dmesg -T: wall-clock stamps
    assert timed == {"0000:18:00": [63, 43]}
    assert health.unhealthy_reasons(gpus[:1], timed) == ["GPU 0 (PCI 0000:18:00): Xid 63 in the kernel log"]


def test_clock_slowdowns_are_reported_not_held_against_the_node():
    gpus = health.parse_gpu_query(fixture("query_gpu_h100_nounits.csv"), health.GPU_FIELDS)[:2]
    fields = ("pci.bus_id", *("clocks_event_reasons." + n for n in health.THROTTLE_NAMES))
    clocks = health.parse_gpu_query(fixture("clocks_event_reasons.csv"), fields)
    health._join(gpus, [dict(c, gpu_bus_id=c["pci.bus_id"]) for c in clocks], fields[1:])
    assert health.throttled(gpus) == ["GPU 1: hw_slowdown, hw_power_brake_slowdown"]
    assert health.unhealthy_reasons(gpus) == ["GPU 1: 2 uncorrected ECC errors"]


def fake_smi(tmp_path: Path, remap: str, clocks: str = "clocks_event_reasons.csv", q: str = "q_row_remapper.txt"):
    """An nvidia-smi that answers each query with a fixture, as the real one would; the
    old clocks_throttle_reasons spelling fails as on a driver that renamed it."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in\n"
                   f"  --query-remapped-rows*) cat '{FIX / remap}';;\n"
                   f"  -q*) cat '{FIX / q}';;\n"
                   f"  *clocks_event_reasons*) cat '{FIX / clocks}';;\n"
                   "  *clocks_throttle_reasons*) echo 'Field is not a valid field to query.'; exit 2;;\n"
                   f"  *) cat '{FIX / 'query_gpu_h100_nounits.csv'}';;\nesac\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return str(smi)


def test_gpu_health_of_a_node_from_a_fake_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setattr(health, "kernel_xids", lambda: health.parse_xids(fixture("dmesg_xid.txt")))
    report = health.gpu_health(fake_smi(tmp_path, "remapped_rows_nounits.csv"))
    assert len(report["gpus"]) == 4 and report["gpus"][0]["driver_version"] == "550.54.15"
    assert report["unhealthy"] == H100_FAULTS + ["GPU 1 (PCI 0000:2a:00): Xid 79 in the kernel log",
                                                 "GPU 2 (PCI 0000:3a:00): Xid 94 in the kernel log",
                                                 "GPU 3 (PCI 0000:5d:00): Xid 48 in the kernel log"]
    assert report["throttled"] == ["GPU 1: hw_slowdown, hw_power_brake_slowdown"]


def test_gpu_health_reads_q_when_the_csv_remap_query_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(health, "kernel_xids", lambda: None)
    report = health.gpu_health(fake_smi(tmp_path, "query_gpu_unknown_field.txt"))
    assert report["xids"] is None
    assert report["unhealthy"] == ["GPU 1: 2 uncorrected ECC errors", "GPU 1: row remapping failed",
                                   "GPU 1: row remapping pending (needs a reset)"]


def test_flag_reads_both_forms():
    assert [health.flag(v) for v in (True, 1, 3, False, 0, None, "Yes")] == [True, True, True, False, False, False,
                                                                             False]


def test_a_node_without_nvidia_smi_is_skipped_not_unhealthy():
    assert health.gpu_health("no-such-nvidia-smi") == {"skipped": "no nvidia-smi on this node"}
