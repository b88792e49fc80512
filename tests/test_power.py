"""A sandbox node switched off and on again (``sandbox.poweroff``/``poweron``): every process of it
ends, connections to it time out as to a machine that is off (no refusal), the other nodes go
on, ``meshkit status`` says the node does not answer; switched on, it boots as after a reboot.
And the words for a node that no route leads to."""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
import time

import paramiko
import pytest
from conftest import meshkit, ssh
from helpers.sandbox_jobs import on_node

from meshkit import sandbox
from meshkit.errors import SandboxError
from meshkit.hostfile import Host
from meshkit.remote.connection import Settings
from meshkit.remote.describe import describe

SANDBOX_NODES = 3
OFF = 1
CONNECT_LIMIT = 2  # seconds a test waits for an answer from the node that is off


def where(lay: sandbox.Layout) -> list[str]:
    return ["--dir", str(lay.root), "--name", lay.name]


def connect_from(lay: sandbox.Layout, index: int, address: str) -> str:
    """What a TCP connection from node ``index`` to ``address``:22 meets: ``ok``, or its error's
    class name (a timeout, a refusal)."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection((sys.argv[1], 22), timeout={CONNECT_LIMIT}).close()\n"
        "    print('ok')\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    out = sandbox.node_exec(lay.nodes[index], [sys.executable, "-c", probe, address])
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def connect_here(address: str) -> str:
    try:
        socket.create_connection((address, 22), timeout=CONNECT_LIMIT).close()
    except OSError as exc:
        return type(exc).__name__
    return "ok"


def test_poweroff_ends_every_process_and_the_node_answers_nothing(cluster):
    off = cluster.nodes[OFF]
    started = ssh(cluster, off.name, "tmux new-session -d -s victim sleep 600; touch /tmp/before")
    assert started.returncode == 0, started.stderr
    assert sandbox.netns_pids(off.netns)
    out = meshkit("sandbox.poweroff", "--node", str(OFF), *where(cluster))
    assert out.returncode == 0, out.stderr
    assert f"{off.name} ({off.address}) powered off" in out.stdout
    assert sandbox.netns_pids(off.netns) == []
    # As a machine that is off: no answer at all, from the controller and from the other nodes.
    assert connect_here(off.address) == "TimeoutError"
    assert connect_from(cluster, 0, off.address) == "TimeoutError"
    began = time.monotonic()
    command = ["ssh", "-F", str(cluster.ssh_config), "-o", "ConnectTimeout=2", off.name, "true"]
    unanswered = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert unanswered.returncode == 255
    assert "timed out" in unanswered.stderr, unanswered.stderr
    assert time.monotonic() - began < 10
    # The others are untouched and reach each other.
    assert ssh(cluster, "node2", "hostname").stdout.strip() == "node2"
    assert connect_from(cluster, 0, cluster.nodes[2].address) == "ok"
    # Safe to repeat; nothing brings its sshd back meanwhile.
    again = meshkit("sandbox.poweroff", "--node", str(OFF), *where(cluster))
    assert again.returncode == 0, again.stderr
    time.sleep(1)
    assert sandbox.netns_pids(off.netns) == []
    shown = meshkit("sandbox.status", *where(cluster), "--json")
    states = json.loads(shown.stdout)
    assert [state["power"] for state in states] == ["on", "off", "on"]
    assert [state["sshd"] for state in states] == [True, False, True]


def test_poweron_boots_the_node_as_a_reboot_does(cluster):
    sandbox.poweroff(cluster, OFF)  # the previous test's state, or this test alone
    off = cluster.nodes[OFF]
    (cluster.node_dir(off) / "tmp" / "left").write_text("from before\n")
    out = meshkit("sandbox.poweron", "--node", str(OFF), *where(cluster))
    assert out.returncode == 0, out.stderr
    assert "powered on" in out.stdout
    after = ssh(cluster, off.name, "hostname; tmux has-session -t victim; echo rc=$?; ls -A /tmp")
    assert after.returncode == 0, after.stderr
    assert after.stdout.splitlines()[0] == off.name
    assert "rc=1" in after.stdout
    assert "left" not in after.stdout
    assert "before" not in after.stdout
    assert connect_from(cluster, 2, off.address) == "ok"
    # A node that is on is left as it is.
    marker = ssh(cluster, off.name, "touch /tmp/still-here")
    assert marker.returncode == 0
    again = meshkit("sandbox.poweron", "--node", str(OFF), *where(cluster))
    assert again.returncode == 0, again.stderr
    assert "is on already" in again.stdout
    assert ssh(cluster, off.name, "ls /tmp/still-here").returncode == 0


def test_poweroff_and_poweron_refuse_bad_nodes_and_have_help(cluster):
    for task in ("sandbox.poweroff", "sandbox.poweron"):
        out = meshkit(task, "--node", "9", *where(cluster))
        assert out.returncode != 0
        assert "nodes 0..2" in out.stderr
        out = meshkit(task, *where(cluster))
        assert out.returncode == 2
        assert "--node I" in out.stderr
        out = meshkit(task, "-h")
        assert out.returncode == 0, out.stderr
        assert "--node" in out.stdout
    with pytest.raises(SandboxError, match=r"nodes 0\.\.2"):
        sandbox.poweroff(cluster, 3)


def test_status_of_a_job_says_a_node_that_is_off_does_not_answer(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "power"
    workdir.mkdir()
    flags = ["--hostfile", str(cluster.hostfile), "--session", "off", "--restarts", "1"]
    out = on_node(cluster, 0, workdir, "train", *flags, "--cmd", "sleep 300")
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        sandbox.poweroff(cluster, OFF)
        # A short connect timeout (MESHKIT_CONNECT_TIMEOUT) keeps the round brief.
        env = "MESHKIT_CONNECT_TIMEOUT=3"
        out = on_node(cluster, 0, workdir, "status", "--session", "off", "--json", env=env)
        rows = json.loads(out.stdout)
        off_row = rows[OFF]
        said = json.dumps(off_row)
        assert "no answer within 3s on port 22" in said, said
        assert "refused" not in said
        assert "sshd running" not in said
        assert all(row["state"] == "running" for index, row in enumerate(rows) if index != OFF)
    finally:
        sandbox.poweron(cluster, OFF)
        stopped = on_node(cluster, 0, workdir, "stop", "--session", "off")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_no_route_to_the_node_is_not_called_a_refusal():
    host = Host("10.0.0.9")
    unreachable = OSError(errno.EHOSTUNREACH, "No route to host")
    paramiko_error = paramiko.ssh_exception.NoValidConnectionsError({("10.0.0.9", 22): unreachable})
    said = describe(paramiko_error, host, Settings())
    assert said == "no route to host on port 22: is the node up and reachable?"
    refusal = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    refused = paramiko.ssh_exception.NoValidConnectionsError({("10.0.0.9", 22): refusal})
    assert describe(refused, host, Settings()) == "connection refused on port 22: is sshd running?"
