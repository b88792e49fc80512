"""What a node sends is data, and what the controller sends fits a line: a node whose job state
holds ``nan`` is that node's error row in ``status`` (no traceback, the other rows shown), a
request too long for one line is a ``MeshkitError`` inside the agent call, and ``write_file``
sends a file of any size in pieces (on real sshd nodes)."""

from __future__ import annotations

import base64
import hashlib
import json
import shlex
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import inside

from meshkit import protocol, sandbox
from meshkit.errors import MeshkitError
from meshkit.hostfile import Host
from meshkit.remote.agent import Agent, AgentPool

SANDBOX_NODES = 3


class Unsent:
    """An agent's channel that must not be written to."""

    def settimeout(self, seconds: float) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        raise AssertionError("a request too long for one line was sent")


def test_a_request_too_long_for_one_line_is_a_meshkit_error_and_leaves_the_agent_usable():
    agent = Agent.__new__(Agent)  # no node: the request must fail before the channel is used
    agent.remote = SimpleNamespace(settings=SimpleNamespace(command_timeout=5.0))
    agent.channel = Unsent()
    agent.broken = None
    oversized = protocol.PutRequest("/tmp/x", "A" * protocol.MAX_LINE, 0, True)
    with pytest.raises(MeshkitError, match="PutRequest was not sent to the node agent: message"):
        agent.call(oversized, protocol.PutReply)
    assert agent.broken is None  # nothing went out: the next request is answered as usual


class Recorded:
    """An agent that keeps every request it is sent."""

    def __init__(self) -> None:
        self.sent: list[protocol.PutRequest] = []

    def call(self, request: protocol.PutRequest, expect: type) -> protocol.PutReply:
        self.sent.append(request)
        return protocol.PutReply(len(request.data))


@pytest.mark.parametrize("size", [0, 1, protocol.PUT_CHUNK, 2 * protocol.PUT_CHUNK + 5])
def test_write_file_sends_pieces_of_put_chunk_bytes_the_last_one_marked(size: int):
    host = Host("10.0.0.1")
    agent = Recorded()
    pool = AgentPool.__new__(AgentPool)  # one connected node whose agent records
    pool.group = SimpleNamespace(remotes={host: SimpleNamespace(host=host)}, failures={})
    pool._agents = {host: agent}
    pool.write_file(host, "/tmp/f", "x" * size, 0o600)
    pieces = max(1, -(-size // protocol.PUT_CHUNK))
    assert [put.offset for put in agent.sent] == [i * protocol.PUT_CHUNK for i in range(pieces)]
    assert [put.last for put in agent.sent] == [False] * (pieces - 1) + [True]
    assert b"".join(base64.b64decode(put.data) for put in agent.sent) == b"x" * size
    assert {(put.mode, put.mtime) for put in agent.sent} == {(0o600, agent.sent[0].mtime)}


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    return cluster


def states(lay, cwd: str, *where: str) -> list[str]:
    out = inside(lay, 0, cwd, "status", "--json", *where)
    assert out.returncode in (0, 1), out.stderr
    return [row["state"] for row in json.loads(out.stdout)]


def wait_for(predicate, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"not reached within {timeout}s")


def test_a_node_whose_started_file_holds_nan_is_its_own_error_row_not_a_traceback(meshed):
    lay = meshed
    work = lay.shared / "nan"
    work.mkdir(parents=True, exist_ok=True)
    where = ("--hostfile", str(lay.hostfile), "--session", "nan")
    out = inside(lay, 0, str(work), "train", *where, "--cmd", "sleep 300")
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        wait_for(lambda: states(lay, str(work), *where) == ["running"] * 3)
        # node 1's started file (its own /tmp), named where node/files.py names it
        find = "from meshkit.node import files; print(files.jobs_root())"
        jobs_root = sandbox.node_exec(lay.nodes[1], [sys.executable, "-c", find]).stdout.strip()
        damage = f"for f in {shlex.quote(jobs_root)}/*/started; do echo nan > $f; done"
        assert sandbox.node_exec(lay.nodes[1], ["bash", "-c", damage]).returncode == 0
        status = inside(lay, 0, str(work), "status", *where)
        shown = status.stdout + status.stderr
        assert status.returncode == 1, shown
        assert "Traceback" not in shown
        rows = status.stdout.splitlines()
        # node 1's row says it answered with an error, and the error follows the table, whole
        errors = [row for row in rows if row.split()[2:3] == ["error"]]
        assert [row.split()[:2] for row in errors] == [["1", lay.nodes[1].address]], shown
        damaged = [row for row in rows if "DamagedState" in row]
        assert len(damaged) == 1, shown
        said = f"node 1 ({lay.nodes[1].address}) answered with an error: "
        assert damaged[0].startswith(said), shown
        running = [row.split()[1] for row in rows if " running " in row]
        assert running == [lay.nodes[0].address, lay.nodes[2].address], shown  # the others' rows
        as_json = inside(lay, 0, str(work), "status", "--json", *where)
        assert as_json.returncode == 1
        lines = [row["last_line"] or "" for row in json.loads(as_json.stdout)]
        assert [line.startswith("error: ") for line in lines] == [False, True, False]
        assert "/started holds 'nan', not a time: stop the job" in lines[1]
    finally:
        inside(lay, 0, str(work), "stop", *where)


def test_write_file_sends_a_2mb_file_whole_in_pieces(meshed):
    """The saved diagnosis of a large job is megabytes: one request line would exceed the
    protocol's limit (and end every supervisor); ``write_file`` sends it in pieces."""
    from meshkit.discovery import read_hosts
    from meshkit.remote import AgentPool, Settings

    lay = meshed
    hosts = read_hosts(lay.hostfile)
    settings = Settings(connect_timeout=5.0, ssh_configs=(str(lay.ssh_config),))
    frame = json.dumps({"rank": 7, "frames": ["step (train.py:42)", "all_reduce (é→✓.py:9)"]})
    text = "".join(f"{frame} {line}\n" for line in range(2 * 1024 * 1024 // len(frame)))
    assert len(text.encode()) > 2 * 1024 * 1024 > protocol.MAX_LINE
    path = "/tmp/meshkit-test-untrusted/diagnosis-1.json"
    with AgentPool.connect(hosts, settings, sys.executable) as pool:
        pool.write_file(hosts[1], path, text, 0o640)
    node = lay.nodes[1]
    listed = sandbox.node_exec(node, ["bash", "-c", f"stat -c %a {path}; sha256sum {path}"])
    mode, digest = listed.stdout.split()[:2]
    assert (mode, digest) == ("640", hashlib.sha256(text.encode()).hexdigest())
    leftovers = sandbox.node_exec(node, ["ls", "-A", "/tmp/meshkit-test-untrusted"]).stdout.split()
    assert leftovers == ["diagnosis-1.json"]  # no temporary left beside it
