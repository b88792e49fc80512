"""``meshkit top``: the node sampler's readings and the GPU fields on recorded NVML and
nvidia-smi values, the odd-one-out marks, the JSON keys and the Prometheus text (parsed with
prometheus_client's parser), all pure; then on the sandbox (3 real sshd nodes): the rank that
busy-loops while the others sleep is marked, and its node; the pair that exchanges traffic has
non-zero rates; a node that is powered off shows as down with why, the view going on, and comes
back when it answers; Ctrl-C leaves the live view at once with the terminal restored.

The sandbox nodes share one kernel: /proc/stat and /proc/meminfo read the same on every node,
while each node's ranks (its own PID namespace) and its interface (its own network namespace)
are its own. The sandbox checks rest only on the latter."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import MESHKIT, meshkit
from helpers.fake_pool import HOSTS, FakePool
from helpers.sandbox_jobs import wait_for
from prometheus_client.parser import text_string_to_metric_families

from meshkit import sandbox
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
    TopReply,
    TopRequest,
    decode_reply,
    encode_reply,
)
from meshkit.sandbox import nodes

SANDBOX_NODES = 3
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
    an idle H200; NVML's memory used counts what the driver reserves (nvidia-smi's does not)."""
    return NvmlReadings(
        index=index,
        name="NVIDIA H200",
        utilization=NvmlAnswer(0, 0),
        memory_used=NvmlAnswer(0, 644_939_776),
        memory_total=NvmlAnswer(0, 150_754_820_096),
        power=NvmlAnswer(0, 78_033),
        power_limit=NvmlAnswer(0, 700_000),
        temperature=NvmlAnswer(0, 32),
    )


def test_nvml_values_decode_to_watts_bytes_and_percent() -> None:
    gpu = decode_nvml(h200_idle(3))
    assert gpu == GpuSample(
        3, "NVIDIA H200", 0.0, 644_939_776, 150_754_820_096, 78.033, 700.0, 32.0
    )


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
    assert any("GPU utilisation 0% while the median is 99%" in m.reason for m in gpu_marks)
    assert any("power (of its limit) 10%" in m.reason for m in gpu_marks)


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
    assert set(data["nodes"][0]["ranks"][0]) == {"rank", "pid", "cpu_percent", "rss_bytes"}
    assert data["nodes"][1]["gpus"] == []
    assert data["nodes"][1]["gpu_source"] == "none"
    down = data["nodes"][2]
    assert down["up"] is False
    assert down["error"] == "unreachable: connection refused on port 22: is sshd running?"


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


# ---- on the sandbox

BUSY = """\
import os, time
print(f"rank {os.environ['RANK']} up", flush=True)
if os.environ["RANK"] == "3":
    while True:
        pass
time.sleep(600)
"""
SINK = """\
import socket
server = socket.create_server(("0.0.0.0", 5201))
connection, _ = server.accept()
while connection.recv(1 << 20):
    pass
"""
SOURCE = """\
import socket, sys, time
connection = socket.create_connection((sys.argv[1], 5201), timeout=10)
block = b"x" * (1 << 20)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    connection.sendall(block)
    time.sleep(0.01)
"""


@pytest.fixture(scope="module")
def busy_job(cluster):
    """The mesh, and a job of 2 ranks per node of which rank 3 (on node 1) busy-loops."""
    hostfile = str(cluster.hostfile)
    out = meshkit("mesh", "--hostfile", hostfile, "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "top"
    workdir.mkdir()
    (workdir / "busy.py").write_text(BUSY)
    flags = ["--hostfile", hostfile, "--spawn", "--nproc-per-node", "2"]
    out = meshkit("train", *flags, "--cmd", "python busy.py", cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    yield cluster, workdir
    meshkit("stop", "--hostfile", hostfile, cwd=workdir)


def top_json(cluster, workdir: Path) -> dict:
    out = meshkit("top", "--hostfile", str(cluster.hostfile), "--json", cwd=workdir, timeout=60)
    assert out.stdout, out.stderr
    return json.loads(out.stdout)


def node_pids(node: sandbox.Node) -> set[int]:
    """The pids of the job's ranks as the node itself sees them (its own PID namespace)."""
    out = sandbox.node_exec(node, ["pgrep", "-f", "python busy.py"])
    return {int(pid) for pid in out.stdout.split()}


@pytest.mark.sandbox
def test_the_busy_rank_and_its_node_are_marked(busy_job) -> None:
    cluster, workdir = busy_job

    def marked() -> dict | None:
        data = top_json(cluster, workdir)
        odd = {(each["kind"], each["what"]) for each in data["odd"]}
        node1 = cluster.nodes[1].address  # as the hostfile names it
        if ("rank", f"rank 3 on {node1}") in odd and ("node", node1) in odd:
            return data
        return None

    # under a loaded machine the spinning rank may get a small share of a core for a moment
    data = wait_for(marked, timeout=90, interval=1)
    assert all(node["up"] for node in data["nodes"])
    for index, node in enumerate(data["nodes"]):
        # each node's ranks are its own (its PID namespace): two, numbered by node, their pids
        # those its own processes have there
        assert [rank["rank"] for rank in node["ranks"]] == [2 * index, 2 * index + 1]
        assert {rank["pid"] for rank in node["ranks"]} <= node_pids(cluster.nodes[index])
        assert node["job_state"] == JobState.RUNNING
        if index != 1:
            assert node["odd"] == [], data["odd"]
        assert node["interface"] == "eth0"
    busy = data["nodes"][1]["ranks"][1]
    assert busy["cpu_percent"] >= odd_one_out.BUSY_RANK
    assert data["nodes"][1]["odd"], data
    assert data["job"].startswith("'meshkit' in ")


@pytest.mark.sandbox
def test_network_rates_on_the_pair_that_exchanges_traffic(busy_job) -> None:
    cluster, workdir = busy_job
    sink = subprocess.Popen(
        [*sandbox.system.nsenter(cluster.nodes[1]), sys.executable, "-c", SINK],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = cluster.nodes[1].address
        wait_for(lambda: listening(cluster.nodes[1], 5201), timeout=20)
        argv = [sys.executable, "-c", SOURCE, address, "20"]
        source = subprocess.Popen([*sandbox.system.nsenter(cluster.nodes[0]), *argv])
        try:

            def measured() -> dict | None:
                data = top_json(cluster, workdir)
                sent = data["nodes"][0]["transmit_bytes_per_s"] or 0
                received = data["nodes"][1]["receive_bytes_per_s"] or 0
                return data if sent > 1e6 and received > 1e6 else None

            data = wait_for(measured, timeout=20, interval=0.5)
        finally:
            source.kill()
            source.wait()
    finally:
        sink.kill()
        sink.wait()
    # the third node's interface is its own: it saw none of that traffic
    third = data["nodes"][2]
    assert (third["receive_bytes_per_s"] or 0) < 1e6
    assert (third["transmit_bytes_per_s"] or 0) < 1e6


def listening(node: sandbox.Node, port: int) -> bool:
    out = sandbox.node_exec(node, ["ss", "-Htln", f"sport = :{port}"])
    return bool(out.stdout.strip())


@pytest.mark.sandbox
def test_prometheus_format_on_the_sandbox_parses(busy_job) -> None:
    cluster, workdir = busy_job
    out = meshkit("top", "--hostfile", str(cluster.hostfile), "--format", "prometheus", cwd=workdir)
    assert out.returncode == 0, out.stderr
    families = {family.name: family for family in text_string_to_metric_families(out.stdout)}
    ranks = families["meshkit_rank_cpu_percent"].samples
    assert sorted(int(sample.labels["rank"]) for sample in ranks) == list(range(6))
    assert {sample.labels["node_rank"] for sample in ranks} == {"0", "1", "2"}
    assert len(families["node_cpu_busy_percent"].samples) == 3
    assert "DCGM_FI_DEV_GPU_UTIL" not in families  # no GPUs here: none shown, no error


class Reader:
    """A process's output, read as it comes in a thread (the test looks at it meanwhile)."""

    def __init__(self, stream) -> None:
        self.text = ""
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.text += line


@pytest.mark.sandbox
def test_a_powered_off_node_is_down_with_why_and_comes_back(busy_job) -> None:
    cluster, workdir = busy_job
    label = cluster.nodes[2].address
    argv = [*MESHKIT, "top", "--hostfile", str(cluster.hostfile), "--interval", "1"]
    view = subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, text=True)
    reader = Reader(view.stdout)
    try:
        wait_for(lambda: "3/3 nodes up" in reader.text, timeout=60)
        nodes.kill_node(cluster.nodes[2].netns)
        down_at = len(reader.text)
        wait_for(lambda: f"{label}  down" in reader.text[down_at:], timeout=30)
        assert view.poll() is None  # the view goes on
        shown = reader.text[down_at:]
        assert "2/3 nodes up" in shown
        nodes.start_node(cluster, cluster.nodes[2])
        nodes.wait_ready(cluster, [cluster.nodes[2]])
        back_at = len(reader.text)
        wait_for(lambda: "3/3 nodes up" in reader.text[back_at:], timeout=60)
        view.send_signal(signal.SIGINT)
        view.wait(timeout=5)
    finally:
        view.kill()
    assert view.returncode == 130
    after_down = reader.text[down_at:]
    lines = [line for line in after_down.splitlines() if line.split()[1:2] == [label]]
    assert any("down" in line and ("refused" in line or "exited" in line) for line in lines)


@pytest.mark.sandbox
def test_ctrl_c_leaves_the_live_view_at_once_and_restores_the_terminal(busy_job) -> None:
    cluster, workdir = busy_job
    argv = [*MESHKIT, "top", "--hostfile", str(cluster.hostfile), "--interval", "1"]
    controller, terminal = pty.openpty()
    view = subprocess.Popen(argv, cwd=workdir, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    shown = b""
    try:
        deadline = time.monotonic() + 60
        while b"nodes up" not in shown and time.monotonic() < deadline:
            if select.select([controller], [], [], 0.5)[0]:
                shown += os.read(controller, 65536)
        assert b"nodes up" in shown, shown[-2000:]
        assert b"\x1b[?25l" in shown  # rich hid the cursor for the live view
        interrupted = time.monotonic()
        view.send_signal(signal.SIGINT)
        view.wait(timeout=5)
        elapsed = time.monotonic() - interrupted
        with_rest = shown
        while select.select([controller], [], [], 0.2)[0]:
            try:
                chunk = os.read(controller, 65536)
            except OSError:
                break
            if not chunk:
                break
            with_rest += chunk
    finally:
        view.kill()
        os.close(controller)
    assert view.returncode == 130
    assert elapsed < 3
    assert with_rest.rfind(b"\x1b[?25h") > with_rest.rfind(b"\x1b[?25l")  # the cursor is back
