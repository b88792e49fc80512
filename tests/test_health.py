"""Node health (issue 44): the readers' pure decoders on recorded data, the kernel-log read loop
on a regular file (as the sandbox bind-mounts one), InfiniBand from a tmp sysfs tree, the job's
baseline, the disk threshold, and the verdict (``judge``, ``words``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from meshkit.health import Finding, HealthLimits, HealthState, SourceRead, judge, words
from meshkit.node import files, gpu_health, health, kernel_log
from meshkit.node.gpu_health import GpuHealth, NvmlHealthAnswers, gpu_findings
from meshkit.node.infiniband import ports
from meshkit.protocol import HealthRequest, StatusReply, decode_reply, encode_reply

UID = 1000
NOW = 1_800_000_000.0
MONO = 5000.0  # the monotonic clock read with NOW


def kmsg(seconds_ago: float, message: str, seq: int = 1) -> str:
    return f"4,{seq},{int((MONO - seconds_ago) * 1e6)},-;{message}"


def kernel(lines: list[str], window: float = 3600.0) -> list[Finding]:
    records = kernel_log.parse_records(lines)
    return kernel_log.findings(records, UID, window, NOW, MONO)


XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off"


def test_xid_found_with_its_table_state_and_time() -> None:
    (found,) = kernel([kmsg(10, XID_79)])
    assert found.state == HealthState.UNHEALTHY
    assert found.code == "xid:79"
    assert found.what == "XID 79 on PCI:0000:3b:00: GPU has fallen off the bus"
    assert found.time == pytest.approx(NOW - 10)


def test_xids_sorted_by_the_table() -> None:
    lines = [
        kmsg(5, "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, Graphics Exception"),
        kmsg(5, "NVRM: Xid (PCI:0000:3b:00): 63, pid=1, row remap"),
        kmsg(5, "NVRM: Xid (PCI:0000:3b:00): 999, pid=1, new"),
    ]
    states = {found.code: found.state for found in kernel(lines)}
    assert states == {
        "xid:13": HealthState.OK,
        "xid:63": HealthState.DEGRADED,
        "xid:999": HealthState.DEGRADED,
    }


def test_old_xid_is_history_and_repeats_are_counted() -> None:
    assert kernel([kmsg(7200, XID_79)]) == []
    (found,) = kernel([kmsg(30, XID_79, 1), kmsg(20, XID_79, 2), kmsg(10, XID_79, 3)])
    assert found.what.endswith("(3 times)")
    assert found.time == pytest.approx(NOW - 10)


def test_continuation_lines_and_other_shapes_skipped() -> None:
    lines = [
        kmsg(5, "usb 1-1: new device"),
        " SUBSYSTEM=pci",
        " DEVICE=+pci:0000:3b:00.0 " + XID_79,
        "garbage " + XID_79,
        "",
        "6,2,notanumber,-;" + XID_79,
    ]
    assert kernel(lines) == []


def test_oom_kills_of_this_user_noted_only() -> None:
    lines = [
        kmsg(5, "Out of memory: Killed process 4242 (python) total-vm:1kB, UID:1000 pgtables:1"),
        kmsg(5, "oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=4242,uid=1000"),
        kmsg(5, "Out of memory: Killed process 77 (other) total-vm:1kB, UID:0 pgtables:1"),
        kmsg(5, "oom-kill:constraint=CONSTRAINT_NONE,task=other,pid=77,uid=0"),
    ]
    (found,) = kernel(lines)
    assert found.code == "oom"
    assert found.state == HealthState.OK
    assert "4242 (python)" in found.what
    assert judge([found], []).state == HealthState.OK


def test_wall_time_from_monotonic() -> None:
    assert kernel_log.wall_time(MONO - 3.5, NOW, MONO) == pytest.approx(NOW - 3.5)


def test_read_loop_on_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    usec = int(time.monotonic() * 1e6)
    path.write_text(f"4,1,{usec},-;{XID_79}\n SUBSYSTEM=pci\n6,2,{usec},-;hello\n" * 3000)
    read = kernel_log.read_kernel_log(str(path))
    assert read.error is None
    assert len(read.lines) == 9000  # split into lines, though each read took many
    found, why = kernel_log.kernel_findings(3600.0, str(path))
    assert why is None
    assert [item.code for item in found] == ["xid:79"]


def test_read_loop_is_bounded_in_bytes(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(b"6,1,1,-;x\n" * 100000)
    read = kernel_log.read_kernel_log(str(path), max_bytes=50000)
    assert 5000 <= len(read.lines) <= 5000 + kernel_log.READ_SIZE // 10 + 1


def test_unreadable_kernel_log_is_said(tmp_path: Path) -> None:
    missing = kernel_log.read_kernel_log(str(tmp_path / "none"))
    assert missing.error
    denied = kernel_log._why(PermissionError(13, "Permission denied"))
    assert denied == kernel_log.UNREADABLE
    assert "dmesg_restrict" in denied


# ---- GPUs


def answers(**changes: tuple[int, ...]) -> NvmlHealthAnswers:
    values: dict[str, object] = {
        "index": 0,
        "bus_id": "00000000:3B:00.0",
        "ecc": (0, 0),
        "remapped": (0, 0, 0),
        "retired": (0, 0),
        "width": (0, 16),
        "width_max": (0, 16),
        "generation": (0, 5),
        "generation_max": (0, 5),
        "throttle": (0, 0),
        "utilization": (0, 90),
    }
    values.update(changes)
    return NvmlHealthAnswers(**values)  # type: ignore[arg-type]


def codes(gpus: list[GpuHealth], expected: int | None = None) -> dict[str, HealthState]:
    return {found.code: found.state for found in gpu_findings(gpus, expected)}


def test_nvml_healthy_gpu_has_no_findings() -> None:
    assert codes([gpu_health.decode_nvml_health(answers())], 1) == {}


def test_nvml_decoding_of_faults() -> None:
    gpu = gpu_health.decode_nvml_health(
        answers(
            ecc=(0, 2),
            remapped=(0, 1, 0),
            retired=(0, 1),
            width=(0, 8),
            generation=(0, 3),
            throttle=(0, 0x8 | 0x40 | 0x80),
        )
    )
    assert codes([gpu]) == {
        "ecc:uncorrected": HealthState.UNHEALTHY,
        "remap:pending": HealthState.DEGRADED,
        "retired:pending": HealthState.DEGRADED,
        "pcie:width": HealthState.DEGRADED,
        "pcie:gen": HealthState.DEGRADED,
        "throttle:thermal": HealthState.DEGRADED,
        "throttle:hw_slowdown": HealthState.DEGRADED,
        "throttle:power_brake": HealthState.DEGRADED,
    }
    failed = gpu_health.decode_nvml_health(answers(remapped=(0, 1, 1)))
    assert codes([failed]) == {"remap:failure": HealthState.UNHEALTHY}


def test_nvml_unsupported_calls_are_no_findings() -> None:
    not_supported = 3
    gpu = gpu_health.decode_nvml_health(
        answers(
            ecc=(not_supported, 5),
            remapped=(not_supported, 1, 1),
            retired=(not_supported, 1),
            throttle=(not_supported, 0xFF),
            width=(0, 0xFFFFFFFF),
        )
    )
    assert gpu.ecc_uncorrected is None
    assert gpu.remap_failure is None
    assert gpu.width is None
    assert codes([gpu]) == {}


def test_idle_link_at_a_lower_generation_is_fine() -> None:
    idle = gpu_health.decode_nvml_health(answers(generation=(0, 1), utilization=(0, 0)))
    assert codes([idle]) == {}


def test_missing_gpus() -> None:
    gpu = gpu_health.decode_nvml_health(answers())
    assert codes([gpu], 2) == {"gpus:missing": HealthState.UNHEALTHY}
    assert "1 GPUs of 2 expected" in gpu_findings([gpu], 2)[0].what


SMI = """\
0, 00000000:3B:00.0, 0, No, No, No, 16, 16, 5, 5, Not Active, Not Active, Not Active, 95
1, 00000000:5E:00.0, 3, Yes, No, [N/A], 8, 16, 2, 5, Active, Not Active, Active, 80
2, 00000000:86:00.0, [N/A], [Not Supported], [Not Supported], [N/A], [N/A], [N/A], 1, 4, \
[Not Supported], [Not Supported], [Not Supported], 0
oops
"""


def test_smi_query_is_the_fixed_one() -> None:
    assert gpu_health.SMI_HEALTH_QUERY == (
        "nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,"
        "remapped_rows.pending,remapped_rows.failure,retired_pages.pending,"
        "pcie.link.width.current,pcie.link.width.max,pcie.link.gen.current,"
        "pcie.link.gen.max,clocks_throttle_reasons.hw_slowdown,"
        "clocks_throttle_reasons.hw_thermal_slowdown,clocks_throttle_reasons.sw_thermal_slowdown,"
        "utilization.gpu --format=csv,noheader,nounits"
    )


def test_smi_csv_parsing() -> None:
    gpus = gpu_health.parse_smi_health(SMI)
    assert [gpu.index for gpu in gpus] == [0, 1, 2]
    assert codes([gpus[0]]) == {}
    assert codes([gpus[1]]) == {
        "ecc:uncorrected": HealthState.UNHEALTHY,
        "remap:pending": HealthState.DEGRADED,
        "pcie:width": HealthState.DEGRADED,
        "pcie:gen": HealthState.DEGRADED,
        "throttle:thermal": HealthState.DEGRADED,
        "throttle:hw_slowdown": HealthState.DEGRADED,
    }
    assert gpus[2].ecc_uncorrected is None
    assert gpus[2].remap_pending is None
    assert codes([gpus[2]]) == {}
    assert "GPU 1 (00000000:5E:00.0)" in gpu_findings([gpus[1]], None)[0].what


# ---- InfiniBand and baselines


def ib_tree(root: Path, state: str, downed: int) -> None:
    port = root / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(f"4: {state}\n")
    (port / "counters" / "link_downed").write_text(f"{downed}\n")
    (port / "counters" / "symbol_error").write_text("0\n")


def test_ib_ports_and_findings(tmp_path: Path) -> None:
    ib_tree(tmp_path, "ACTIVE", 1)
    baseline = health.Baseline()
    assert health.ib_findings(ports(str(tmp_path)), baseline) == []
    assert baseline.counters == {"mlx5_0:1 link_downed": 1, "mlx5_0:1 symbol_error": 0}
    ib_tree(tmp_path, "DOWN", 3)
    found = health.ib_findings(ports(str(tmp_path)), baseline)
    assert [(item.code, item.state) for item in found] == [
        ("ib:down", HealthState.UNHEALTHY),
        ("ib:errors", HealthState.DEGRADED),
    ]
    assert "link_downed 1->3" in found[1].what
    ib_tree(tmp_path, "ACTIVE", 0)  # a reset: the baseline follows
    assert health.ib_findings(ports(str(tmp_path)), baseline) == []
    assert baseline.counters["mlx5_0:1 link_downed"] == 0


def test_baseline_parsing_is_defensive() -> None:
    assert health.parse_baseline(None) == health.Baseline()
    assert health.parse_baseline("[1]") == health.Baseline()
    assert health.parse_baseline('{"gpus": true, "counters": {"a": "x", "b": 2}}') == (
        health.Baseline(None, {"b": 2})
    )
    kept = health.Baseline(4, {"p link_downed": 1})
    assert health.parse_baseline(health.baseline_json(kept)) == kept


@pytest.fixture
def state_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "state"
    monkeypatch.setattr(files, "state_root", lambda: str(root))
    return root


def test_read_health_keeps_a_baseline_per_job(
    tmp_path: Path, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = [GpuHealth(0), GpuHealth(1)]
    read = gpu_health.GpuHealthRead(gpus, "nvidia-smi")
    monkeypatch.setattr(gpu_health, "read_gpu_health", lambda: read)
    log = tmp_path / "kmsg"
    log.write_text("")
    request = HealthRequest(str(tmp_path), "ab" * 8, gpus=1)
    first = health.read_health(request, str(log), str(tmp_path / "noib"))
    assert first.state == HealthState.OK
    baseline = Path(files.health_baseline("ab" * 8))
    assert health.parse_baseline(baseline.read_text()).gpus == 2
    assert os.stat(baseline).st_mode & 0o777 == 0o600
    assert os.stat(state_root / "health").st_mode & 0o777 == 0o700
    read.gpus.pop()  # one fell off the bus: fewer than this job first saw
    second = health.read_health(request, str(log), str(tmp_path / "noib"))
    assert second.state == HealthState.UNHEALTHY
    assert [item.code for item in second.findings] == ["gpus:missing"]
    assert "1 GPUs of 2 expected" in words(second)


def test_no_driver_is_nothing_to_read_and_kernel_unread_is_unknown(
    tmp_path: Path, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_health, "read_gpu_health", lambda: gpu_health.GpuHealthRead([], ""))
    request = HealthRequest(str(tmp_path), gpus=4)
    found = health.read_health(request, str(tmp_path / "nokmsg"), str(tmp_path / "noib"))
    assert SourceRead("gpu", "", None) in found.sources
    assert found.state == HealthState.UNKNOWN
    assert found.reasons[0].startswith("kernel: not read:")


def test_unreadable_gpus_are_unknown(
    tmp_path: Path, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails() -> gpu_health.GpuHealthRead:
        raise gpu_health.NvmlError("nvidia-smi exited 9: no devices")

    monkeypatch.setattr(gpu_health, "read_gpu_health", fails)
    log = tmp_path / "kmsg"
    log.write_text("")
    found = health.read_health(HealthRequest(str(tmp_path)), str(log), str(tmp_path / "noib"))
    assert found.state == HealthState.UNKNOWN
    assert "gpu: not read: nvidia-smi exited 9" in words(found)


def test_disk_threshold(tmp_path: Path) -> None:
    free = health.free_mib(str(tmp_path))
    assert health.disk_findings([str(tmp_path)], 1) == ([], None)
    found, why = health.disk_findings([str(tmp_path)], int(free) + 1_000_000)
    assert why is None
    assert found[0].code == "disk:full"
    assert found[0].state == HealthState.UNHEALTHY
    assert str(tmp_path) in found[0].what
    assert "MiB free" in found[0].what
    _, why = health.disk_findings([str(tmp_path / "gone")], 1)
    assert why is not None
    assert "gone" in why


# ---- the verdict and the wire


def test_judge_and_words() -> None:
    xid = Finding("kernel", HealthState.UNHEALTHY, "xid:79", "XID 79 on PCI:1: off the bus")
    noted = Finding("kernel", HealthState.OK, "oom", "out of memory")
    unread = SourceRead("kernel", "/dev/kmsg", "not readable")
    assert judge([], []).state == HealthState.OK
    assert words(judge([noted], [])) == "ok"
    assert judge([noted], [unread]).state == HealthState.UNKNOWN
    verdict = judge([xid, noted], [unread])
    assert verdict.state == HealthState.UNHEALTHY
    assert verdict.as_json() == {
        "state": "unhealthy",
        "reasons": ["kernel: XID 79 on PCI:1: off the bus", "kernel: not read: not readable"],
    }
    assert words(verdict).startswith("unhealthy: kernel: XID 79")


def test_health_travels_in_a_status_reply() -> None:
    verdict = judge([Finding("disk", HealthState.UNHEALTHY, "disk:full", "/w: 3 MiB")], [])
    reply = StatusReply("exited", 0, None, None, health=verdict, ended=NOW)  # type: ignore[arg-type]
    assert decode_reply("status", encode_reply(reply)) == reply


def test_limits_default_as_documented() -> None:
    assert HealthLimits() == HealthLimits(min_free_mib=1024, xid_window=3600.0)
