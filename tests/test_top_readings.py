"""``meshkit top``'s pure parts: the node sampler's readings of /proc, the GPU fields on recorded
NVML and nvidia-smi values (NVML's as node/gpu_readings.py read them on a real H200), the
odd-one-out marks, the JSON keys and the Prometheus text, parsed with prometheus_client's parser.
The sandbox side is tests/test_top.py."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.fake_pool import HOSTS, FakePool
from prometheus_client.parser import text_string_to_metric_families

from meshkit.job import Job
from meshkit.node import gpu_readings, top
from meshkit.node.gpu_readings import NvmlAnswer, NvmlReadings, decode_nvml, parse_smi
from meshkit.ops import odd_one_out
from meshkit.ops import top as op
from meshkit.ops.top_prometheus import prometheus
from meshkit.protocol import (
    GpuSample,
    JobState,
    PortRate,
    RankSample,
    Supervision,
    SupervisorReply,
    SupervisorState,
    TopReply,
    TopRequest,
    decode_reply,
    encode_reply,
)

GIB = 1 << 30

# nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used,memory.total,power.draw,
# power.limit,temperature.gpu --format=csv,noheader,nounits, as printed on an 8 x A100 node
# during a job whose GPU 5 hung (first four lines), on a GeForce that reports no power, and on
# the idle H200 whose NVML answers h200_idle records
SMI_RECORDED = """\
0, NVIDIA A100-SXM4-80GB, 100, 78453, 81920, 389.54, 400.00, 63
1, NVIDIA A100-SXM4-80GB, 99, 78453, 81920, 377.02, 400.00, 61
5, NVIDIA A100-SXM4-80GB, 0, 78453, 81920, 61.07, 400.00, 34
7, NVIDIA A100-SXM4-80GB, 100, 78453, 81920, 392.11, 400.00, 65
0, NVIDIA GeForce RTX 3090, 5, 1234, 24576, [N/A], [Not Supported], 45
0, NVIDIA H200, 0, 0, 143771, 77.70, 700.00, 40
"""


def h200_idle(index: int = 0) -> NvmlReadings:
    """NVML's raw answers (milliwatts, bytes) as node/gpu_readings.py read them through ctypes on
    an idle H200 (memory through GetMemoryInfo_v2: the driver's reservation, 615 MiB there, is
    not used memory, as nvidia-smi counts it)."""
    return NvmlReadings(
        index=index,
        name="NVIDIA H200",
        utilization=NvmlAnswer(0, 0),
        memory_used=NvmlAnswer(0, 0),
        memory_total=NvmlAnswer(0, 150_754_820_096),
        power=NvmlAnswer(0, 79_676),
        power_limit=NvmlAnswer(0, 700_000),
        temperature=NvmlAnswer(0, 34),
    )


def test_nvml_values_decode_to_watts_bytes_and_percent() -> None:
    gpu = decode_nvml(h200_idle(3))
    assert gpu == GpuSample(3, "NVIDIA H200", 0.0, 0, 150_754_820_096, 79.676, 700.0, 34.0)
    smi = parse_smi(SMI_RECORDED)[-1]  # the same GPU through nvidia-smi: the same memory
    assert (smi.memory_used, smi.memory_total) == (gpu.memory_used, gpu.memory_total)


def test_nvml_calls_that_failed_or_have_no_value_are_none() -> None:
    not_supported = NvmlAnswer(3, 0)  # NVML_ERROR_NOT_SUPPORTED (a MIG slice, a GeForce)
    readings = NvmlReadings(
        0,
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        NvmlAnswer(0, 0xFFFFFFFF),  # NVML_VALUE_NOT_AVAILABLE
        NvmlAnswer(0, 1 << 20),
        NvmlAnswer(0, 5 << 30),
        not_supported,
        not_supported,
        NvmlAnswer(0, 255 + 0xFFFFFF00),  # garbage past the sensor's range is still a number
    )
    gpu = decode_nvml(readings)
    assert gpu.utilization is None
    assert gpu.power is None
    assert gpu.power_limit is None
    assert gpu.memory_total == 5 * GIB
    bad_percent = NvmlReadings(**{**h200_idle().__dict__, "utilization": NvmlAnswer(0, 140)})
    assert decode_nvml(bad_percent).utilization is None


def test_nvidia_smi_csv_parses_with_units_and_not_available() -> None:
    gpus = parse_smi(SMI_RECORDED)
    assert [gpu.index for gpu in gpus] == [0, 1, 5, 7, 0, 0]
    assert gpus[0] == GpuSample(
        0, "NVIDIA A100-SXM4-80GB", 100.0, 78453 << 20, 81920 << 20, 389.54, 400.0, 63.0
    )
    geforce = gpus[4]
    assert geforce.name == "NVIDIA GeForce RTX 3090"
    assert geforce.power is None
    assert geforce.power_limit is None
    assert geforce.memory_total == 24 * GIB
    h200 = gpus[5]
    assert (h200.memory_total, h200.power, h200.power_limit) == (143771 << 20, 77.7, 700.0)
    assert parse_smi("") == []
    assert parse_smi("No devices were found\n") == []


def test_no_gpu_driver_is_no_gpus_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(gpu_readings, "NVML_LIBRARY", "libnvidia-ml-absent.so.1")
    readings = gpu_readings.read_gpus()
    assert readings == gpu_readings.GpuReadings([], "none", None)


def test_proc_counters_parse() -> None:
    stat = "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert top.cpu_ticks(stat) == (160, 1000)  # idle and iowait are not busy; guest is in user
    meminfo = "MemTotal:       16000000 kB\nMemFree:  1 kB\nMemAvailable:   12000000 kB\n"
    assert top.memory(meminfo) == (4_000_000 * 1024, 16_000_000 * 1024)
    net = (
        "Inter-|   Receive    |  Transmit\n face |bytes packets|bytes\n"
        "    lo: 500 5 0 0 0 0 0 0 500 5 0 0 0 0 0 0\n"
        "  eth0: 123456 100 0 0 0 0 0 0 654321 90 0 0 0 0 0 0\n"
    )
    assert top.net_dev(net)["eth0"] == top.Port("eth0", 123456, 654321)
    # a command name with spaces and parentheses: the fields start after the last ')'
    process = "4242 (python (rank) 3) R 1 4242 4242 0 -1 4194304 10 0 0 0 250 50 0 0 20 0 1 0"
    assert top.process_ticks(process) == 300
    assert top.resident_bytes("1000 25 3 1 0 20 0") == 25 * os.sysconf("SC_PAGE_SIZE")


def test_a_sample_here_is_a_valid_reply_with_rates() -> None:
    reply = top.sample(TopRequest("127.0.0.1", settle=0.2))
    again = decode_reply("top", encode_reply(reply))
    assert again == reply
    assert reply.cpu is not None and 0 <= reply.cpu <= 100
    assert 0 < reply.memory_used < reply.memory_total
    assert reply.gpu_source in ("nvml", "nvidia-smi", "none")


def node_sample(
    cpu: float = 10.0,
    ranks: list[RankSample] | None = None,
    gpus: list[GpuSample] | None = None,
    traffic: float = 0.0,
) -> TopReply:
    port = PortRate("eth0", 10**9, 10**9, traffic / 2, traffic / 2)
    return TopReply(
        "node",
        8,
        cpu,
        GIB,
        16 * GIB,
        [1.0, 1.0, 1.0],
        "eth0",
        [port],
        gpus or [],
        "nvml" if gpus else "none",
        ranks or [],
    )


def gpu(index: int, utilization: float, power: float = 350.0) -> GpuSample:
    return GpuSample(index, "NVIDIA H100 80GB HBM3", utilization, GIB, 80 * GIB, power, 700.0, 60.0)


def test_the_gpu_at_zero_while_the_others_compute_is_the_odd_one() -> None:
    busy = [gpu(0, 100.0), gpu(1, 98.0)]
    samples = [
        ("n0", node_sample(gpus=busy)),
        ("n1", node_sample(gpus=[gpu(0, 100.0), gpu(1, 0.0, power=70.0)])),
        ("n2", node_sample(gpus=busy)),
    ]
    marks = odd_one_out.mark(samples)
    gpu_marks = [mark for mark in marks if mark.kind == "gpu"]
    assert {mark.what for mark in gpu_marks} == {"GPU 1 on n1"}
    assert any("GPU utilisation 0% while the median is 99%" in mark.reason for mark in gpu_marks)
    assert any("power (of its limit) 10%" in mark.reason for mark in gpu_marks)


def test_busy_gpus_at_low_power_are_marked_as_nccl_hangs_look() -> None:
    samples = [(f"n{i}", node_sample(gpus=[gpu(0, 100.0, 650.0)])) for i in range(4)]
    samples[2] = ("n2", node_sample(gpus=[gpu(0, 100.0, 120.0)]))
    marks = odd_one_out.mark(samples)
    assert [(mark.kind, mark.what) for mark in marks] == [("gpu", "GPU 0 on n2")]


def test_one_busy_rank_among_sleeping_ones_marks_it_and_its_node() -> None:
    def ranks(first: int, cpus: list[float]) -> list[RankSample]:
        return [RankSample(first + i, 100 + i, cpu, GIB) for i, cpu in enumerate(cpus)]

    samples = [
        ("n0", node_sample(ranks=ranks(0, [0.5, 0.0]))),
        ("n1", node_sample(ranks=ranks(2, [0.0, 35.0]))),
        ("n2", node_sample(ranks=ranks(4, [0.2, 0.1]))),
    ]
    marks = odd_one_out.mark(samples)
    assert {(mark.kind, mark.what) for mark in marks} == {("rank", "rank 3 on n1"), ("node", "n1")}


def test_no_odd_one_without_a_minority_or_enough_peers() -> None:
    half = [("a", node_sample(cpu=90.0)), ("b", node_sample(cpu=90.0))]
    half += [("c", node_sample(cpu=1.0)), ("d", node_sample(cpu=1.0))]
    assert odd_one_out.mark(half) == []
    two = [("a", node_sample(cpu=90.0)), ("b", node_sample(cpu=0.0))]
    assert odd_one_out.mark(two) == []


def test_the_node_whose_network_is_idle_is_marked() -> None:
    samples = [(f"n{i}", node_sample(traffic=5e8)) for i in range(3)]
    samples.append(("n3", node_sample(traffic=1e3)))
    marks = odd_one_out.mark(samples)
    assert [mark.what for mark in marks] == ["n3"]
    assert "network 0.0 MB/s while the median is 500.0 MB/s" in marks[0].reason


NODE_KEYS = {
    "node",
    "node_rank",
    "up",
    "error",
    "odd",
    "hostname",
    "cpus",
    "cpu_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "load",
    "interface",
    "receive_bytes_per_s",
    "transmit_bytes_per_s",
    "ports",
    "gpu_source",
    "gpus",
    "ranks",
    "job_state",
    "idle_s",
    "stalled",
    "history",
    "health",
    "straggler",  # issue 45: null, or its ratio when it is one
}
GPU_KEYS = {
    "index",
    "name",
    "utilization_percent",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_watts",
    "power_limit_watts",
    "temperature_celsius",
}


def fake_snapshot() -> op.Snapshot:
    """Node 0 with two GPUs and a rank, node 1 with none, node 2 unreachable."""
    with_gpus = node_sample(ranks=[RankSample(0, 41, 97.0, GIB)], gpus=[gpu(0, 99.0), gpu(1, 0.0)])
    pool = FakePool(
        {"top": {HOSTS[0]: with_gpus, HOSTS[1]: node_sample()}},
        failures={HOSTS[2]: "connection refused on port 22: is sshd running?"},
    )
    return op.snapshot(pool, HOSTS, None)


def test_json_has_the_documented_keys_and_a_down_node_says_why() -> None:
    data = json.loads(json.dumps(fake_snapshot().as_json()))
    assert set(data) == {"time", "interval", "job", "supervisor", "stalled", "nodes", "odd"}
    for node in data["nodes"]:
        assert set(node) == NODE_KEYS
    assert set(data["nodes"][0]["gpus"][0]) == GPU_KEYS
    # issue 45: each rank's step, rate and age (null: it tells no steps)
    rank_keys = {"rank", "pid", "cpu_percent", "rss_bytes", "step", "rate", "age"}
    assert set(data["nodes"][0]["ranks"][0]) == rank_keys
    assert data["nodes"][1]["gpus"] == []
    assert data["nodes"][1]["gpu_source"] == "none"
    down = data["nodes"][2]
    assert down["up"] is False
    assert down["error"] == "unreachable: connection refused on port 22: is sshd running?"


def test_a_live_view_connects_to_a_down_node_again_and_a_lone_snapshot_does_not() -> None:
    """``Watch`` asks the pool to open a down node's connection again (``NodePool.reconnect``),
    in the background; ``top --once`` has no later round to show the node in."""
    pool = FakePool(
        {"top": {HOSTS[0]: node_sample(), HOSTS[1]: node_sample()}},
        failures={HOSTS[2]: "connection refused on port 22: is sshd running?"},
    )
    op.snapshot(pool, HOSTS, None)
    assert pool.reconnected == []
    op.Watch(pool, HOSTS, None, interval=0.0).snapshot()
    deadline = time.monotonic() + 10.0
    while not pool.reconnected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.reconnected == [HOSTS[2]]


def test_prometheus_text_parses_with_dcgm_and_node_exporter_names() -> None:
    text = prometheus(fake_snapshot())
    families = {family.name: family for family in text_string_to_metric_families(text)}
    utilization = families["DCGM_FI_DEV_GPU_UTIL"].samples
    assert [(sample.labels["gpu"], sample.value) for sample in utilization] == [
        ("0", 99.0),
        ("1", 0.0),
    ]
    assert utilization[0].labels["node"] == "10.0.0.1"
    assert utilization[0].labels["node_rank"] == "0"
    assert families["DCGM_FI_DEV_FB_USED"].samples[0].value == 1024  # MiB, as DCGM counts
    assert families["DCGM_FI_DEV_POWER_USAGE"].samples[0].value == 350.0
    assert families["DCGM_FI_DEV_GPU_TEMP"].samples[0].value == 60.0
    assert families["node_memory_MemTotal_bytes"].samples[0].value == 16 * GIB
    # the text parser names a counter's family without its _total
    received = families["node_network_receive_bytes"].samples[0]
    assert received.labels["device"] == "eth0"
    rank = families["meshkit_rank_cpu_percent"].samples[0]
    assert (rank.labels["rank"], rank.value) == ("0", 97.0)
    up = {sample.labels["node"]: sample.value for sample in families["meshkit_node_up"].samples}
    assert up == {"10.0.0.1": 1.0, "10.0.0.2": 1.0, "10.0.0.3": 0.0}


def test_a_supervised_stalled_job_shows_its_supervisor_and_stall(tmp_path: Path) -> None:
    """The job's part: each node's state and quiet time, the job stalled when every running node
    has been quiet for stall_after, the supervision as status words it (leader: node 1, whose
    supervisor beat recently)."""
    hostfile = tmp_path / "hostfile"  # top reads it: a copy far ahead is judged by its size
    hostfile.write_text("".join(f"{host.host}\n" for host in HOSTS))
    job = Job("x", "/w", "s", str(hostfile), "/p", 1, restarts=2, stall_after=60.0)
    running = replace(node_sample(), job_state=JobState.RUNNING, idle=300.0)
    record = Supervision(SupervisorState.RUNNING, 2, 1)
    beating = SupervisorReply(pid=7, beat=1.0, left=[], record=record)
    silent = SupervisorReply(pid=None, beat=None, left=[], record=None)
    pool = FakePool(
        {
            "top": {host: running for host in HOSTS},
            "supervisor": {HOSTS[0]: silent, HOSTS[1]: beating, HOSTS[2]: silent},
        }
    )
    snapshot = op.snapshot(pool, HOSTS, job)
    assert snapshot.stalled
    assert all(view.stalled for view in snapshot.nodes)
    assert snapshot.supervisor == "running, attempt 2 of 3 (leader: node 1)"
    asked = [request for op_name, _, request in pool.calls if op_name == "top"]
    assert [request.log for request in asked] == [job.log(rank) for rank in range(3)]


def test_the_plain_screen_shows_gpus_infiniband_and_a_down_node() -> None:
    from meshkit.cli.tasks.top import plain

    infiniband = PortRate("mlx5_0:1", 10**12, 10**12, 12.5e9, 12.5e9)
    with_port = replace(node_sample(gpus=[gpu(0, 99.0), gpu(1, 97.0)]), ports=[infiniband])
    pool = FakePool(
        {"top": {HOSTS[0]: with_port, HOSTS[1]: node_sample()}},
        failures={HOSTS[2]: "connection refused on port 22: is sshd running?"},
    )
    screen = plain(op.snapshot(pool, HOSTS, None), per_gpu=True)
    lines = screen.splitlines()
    assert lines[0].startswith("meshkit top") and "2/3 nodes up" in lines[0]
    assert lines[1].split()[:9] == [
        "rank",
        "node",
        "cpu",
        "memory",
        "load",
        "rx/s",
        "tx/s",
        "ib",
        "rx/s",
    ]
    node0 = lines[2].split()
    assert "11.6GB" in node0  # 12.5e9 bytes/s received over InfiniBand
    assert "2" in node0 and "98%" in node0  # two GPUs, their mean utilisation
    assert " none " in lines[3]  # no GPUs: said so
    assert "down: unreachable: connection refused on port 22" in lines[4]
    gpu_rows = [line for line in lines if line.startswith("10.0.0.1  ")]
    assert len(gpu_rows) == 2


def test_an_unhealthy_node_is_marked_and_every_node_carries_its_health() -> None:
    """Issue 44: top asks each node's health; --json nodes carry {"state", "reasons"}; an
    unhealthy node is marked as the odd one out is, and said so below the table."""
    from meshkit.cli.tasks.top import footer, node_table
    from meshkit.health import Finding, HealthState, judge

    xid = Finding("kernel", HealthState.UNHEALTHY, "xid:79", "XID 79 on PCI:0000:3b:00: off")
    well = replace(node_sample(), health=judge([], []))
    sick = replace(node_sample(), health=judge([xid], []))
    hosts = [replace(HOSTS[0], slots=4), HOSTS[1], HOSTS[2]]
    pool = FakePool({"top": {hosts[0]: well, hosts[1]: sick, hosts[2]: node_sample()}})
    snapshot = op.snapshot(pool, hosts, None)
    asked = [request for _, _, request in pool.calls]
    assert asked[0].health is not None
    assert asked[0].health.gpus == 4
    data = json.loads(json.dumps(snapshot.as_json()))
    assert [node["health"] for node in data["nodes"]] == [
        {"state": "ok", "reasons": []},
        {"state": "unhealthy", "reasons": ["kernel: XID 79 on PCI:0000:3b:00: off"]},
        None,
    ]
    assert data["nodes"][1]["odd"] == [
        "10.0.0.2 is unhealthy: kernel: XID 79 on PCI:0000:3b:00: off"
    ]
    headers, rows = node_table(snapshot)
    column = headers.index("health")
    assert [row[column] for row in rows] == ["ok", "unhealthy", "-"]
    assert "10.0.0.2 is unhealthy: kernel: XID 79 on PCI:0000:3b:00: off" in footer(snapshot)
