"""``meshkit top`` on the sandbox (3 real sshd nodes): the rank that busy-loops while the others
sleep is marked, and its node; the pair that exchanges traffic has non-zero rates; the Prometheus
text parses; a node that is powered off shows as down with why, the view going on, and comes back
when it answers; Ctrl-C leaves the live view at once with the terminal restored, and no agent
is left on any node. The pure parts are tests/test_top_readings.py.

The sandbox nodes share one kernel: /proc/stat and /proc/meminfo read the same on every node,
while each node's ranks (its own PID namespace) and its interface (its own network namespace)
are its own. These checks rest only on the latter."""

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
from helpers.sandbox_jobs import script_job, wait_for
from prometheus_client.parser import text_string_to_metric_families

from meshkit import sandbox
from meshkit.ops import odd_one_out
from meshkit.protocol import JobState
from meshkit.sandbox import nodes

SANDBOX_NODES = 3

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
    flags = ["--spawn", "--nproc-per-node", "2"]
    workdir = script_job(cluster, "busy", BUSY, "python busy.py", *flags)
    yield cluster, workdir
    meshkit("stop", "--hostfile", str(cluster.hostfile), cwd=workdir)


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


def agents_left(lay: sandbox.Layout) -> list[str]:
    left = []
    for node in lay.nodes:
        out = sandbox.node_exec(node, ["pgrep", "-af", "meshkit.node serve"])
        left += [line for line in out.stdout.splitlines() if "pgrep" not in line]
    return left


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
    # nothing of top keeps running on the nodes: each agent ended with its connection
    wait_for(lambda: not agents_left(cluster), timeout=15)
    assert with_rest.rfind(b"\x1b[?25h") > with_rest.rfind(b"\x1b[?25l")  # the cursor is back
