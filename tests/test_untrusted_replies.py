"""Sandbox: a node that sends a 5,000-digit number or a lone surrogate gives no traceback
anywhere. On real sshd nodes, under a UTF-8 locale: a supervised job's copies of its record on
two nodes are damaged (a 5,000-digit version, a lone surrogate in the restart reason), and one
node's agent answers ``top`` with such a reply; ``status``, ``status --json``, ``top --once``,
``top --json`` and ``top --format prometheus`` each end without a traceback, and ``stop`` still
stops the job on every node."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import private, wait_for

from meshkit import sandbox

SANDBOX_NODES = 3
SESSION = "lies"
UTF8 = {"LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
PYTHON = Path("/tmp/meshkit-test-python")  # each node's own /tmp: node 2's lies
LIE = Path("/tmp/meshkit-test-lie")  # what node 2's agent sends for top: "huge" or "lone"

# node 2's agent: a real agent, except that it answers top with a reply no node should send
LYING_AGENT = """
import io, json, sys
from meshkit import protocol
from meshkit.node import agent

MARK = 7777777777777
while True:
    line = sys.stdin.readline()
    if not line:
        break
    if json.loads(line).get("op") != "top":
        agent.serve(io.StringIO(line), sys.stdout)
        continue
    lie = open("{lie}").read().strip()
    name = "gpu \\ud800" if lie == "lone" else "gpu"
    gpu = protocol.GpuSample(0, name, 1.0, MARK, MARK, 1.0, 1.0, 1.0)
    port = protocol.PortRate("eth0", MARK, 1, 1.0, 1.0)
    reply = protocol.TopReply(
        "node", 2, 1.0, 1, 2, [0.0, 0.0, 0.0], "eth0", [port], [gpu], "nvml", []
    )
    digits = "9" * 5000 if lie == "huge" else "1"
    sys.stdout.write(protocol.encode_reply(reply).replace(str(MARK), digits))
    sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def lying(cluster):
    """The mesh, every node's interpreter a wrapper (config ``python``), node 2's running the
    lying agent, and a supervised job running on all three nodes."""
    hostfile = str(cluster.hostfile)
    out = meshkit("mesh", "--hostfile", hostfile, "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    for index in range(SANDBOX_NODES):
        wrapper = "#!/bin/sh\n"
        if index == 2:
            script = private(cluster, index, Path("/tmp/meshkit-test-lying-agent.py"))
            script.write_text(LYING_AGENT.replace("{lie}", str(LIE)))
            wrapper += 'if [ "$*" = "-m meshkit.node serve" ]; then\n'
            wrapper += f"  exec {shlex.quote(sys.executable)} /tmp/{script.name}\nfi\n"
            private(cluster, index, LIE).write_text("huge\n")
        wrapper += f'exec {shlex.quote(sys.executable)} "$@"\n'
        path = private(cluster, index, PYTHON)
        path.write_text(wrapper)
        path.chmod(0o755)
    workdir = cluster.shared / "lies"
    workdir.mkdir()
    (workdir / "meshkit.yaml").write_text(f"python: {PYTHON}\n")
    flags = ["--hostfile", hostfile, "--session", SESSION]
    out = meshkit("train", *flags, "--restarts", "3", "--cmd", "sleep 600", cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    yield cluster, workdir, flags
    meshkit("stop", *flags, cwd=workdir)


def run(workdir: Path, *args: str):
    """meshkit under a UTF-8 locale, checked for a traceback."""
    out = meshkit(*args, cwd=workdir, env=UTF8, timeout=120)
    said = out.stdout + out.stderr
    assert "Traceback" not in said, said
    assert out.returncode in (0, 1), said
    return out


def damage(node: sandbox.Node, old: str, new: str) -> None:
    """Replace ``old`` (a regular expression) by ``new`` in the node's copy of the record."""
    code = f"""
import glob, re
from meshkit.node import files
(copy,) = glob.glob(files.supervisors_root() + "/*.json")
text = open(copy).read()
damaged = re.sub({old!r}, {new!r}, text)
assert damaged != text, text
open(copy, "w").write(damaged)
"""
    done = sandbox.node_exec(node, [sys.executable, "-c", code])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.sandbox
def test_numbers_and_surrogates_from_nodes_give_no_traceback_and_stop_still_stops(lying):
    cluster, workdir, flags = lying

    def supervised() -> bool:
        out = run(workdir, "status", *flags, "--json")
        rows = json.loads(out.stdout)
        return bool(rows) and rows[0].get("supervisor") == "running"

    wait_for(supervised, timeout=90)
    damage(cluster.nodes[1], r'"version": \d+', '"version": ' + "9" * 5000)
    damage(
        cluster.nodes[2],
        r'"last_restart_reason": (null|"[^"]*")',
        r'"last_restart_reason": "\\ud800"',
    )

    shown = run(workdir, "status", *flags)
    assert cluster.nodes[2].address in shown.stdout, shown.stdout
    rows = json.loads(run(workdir, "status", *flags, "--json").stdout)
    assert len(rows) == SANDBOX_NODES
    for lie in ("huge", "lone"):
        private(cluster, 2, LIE).write_text(f"{lie}\n")
        once = run(workdir, "top", *flags, "--once")
        assert cluster.nodes[0].address in once.stdout + once.stderr
        data = json.loads(run(workdir, "top", *flags, "--json").stdout)
        assert data, lie
        metrics = run(workdir, "top", *flags, "--format", "prometheus")
        metrics.stdout.encode("utf-8")  # every line printable

    stopped = meshkit("stop", *flags, cwd=workdir, env=UTF8, timeout=180)
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0, said
    assert "Traceback" not in said
    for node in cluster.nodes:
        sessions = sandbox.node_exec(node, ["tmux", "ls"]).stdout
        assert SESSION not in sessions, sessions
