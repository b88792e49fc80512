"""A job's history on the sandbox (real sshd, tmux; issue 44 item 7): ``train`` writes the
launch and ``stop`` the stop on every node of the job, each node its own file in the shared
job home, and ``meshkit events`` run inside node 2 after node 0 (the leader and master) was
powered off still shows the whole history, merged, each event once."""

from __future__ import annotations

import json

from conftest import meshkit
from helpers.sandbox_jobs import on_node

from meshkit import sandbox

SANDBOX_NODES = 3
SESSION = "hist"


def test_the_history_survives_the_leader_powered_off(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "history"
    workdir.mkdir()
    flags = ["--hostfile", str(cluster.hostfile), "--session", SESSION]
    out = on_node(cluster, 0, workdir, "train", *flags, "--restarts", "1", "--cmd", "sleep 600")
    assert out.returncode == 0, out.stdout + out.stderr
    out = on_node(cluster, 1, workdir, "stop", "--session", SESSION)
    assert out.returncode == 0, out.stdout + out.stderr
    # each node its own file in the shared home, none through another's
    kept = workdir / ".meshkit" / SESSION / "events"
    assert sorted(path.name for path in kept.iterdir()) == [
        f"{node.name}.jsonl" for node in cluster.nodes
    ]
    try:
        sandbox.poweroff(cluster, 0)
        env = "MESHKIT_CONNECT_TIMEOUT=3"  # node 0 is off: a short wait for it
        out = on_node(cluster, 2, "/", "events", *flags, "--json", env=env)  # type: ignore[arg-type]
        assert out.returncode == 1, out.stdout + out.stderr  # node 0 could not be read ...
        assert "not read" in out.stderr
        assert cluster.nodes[0].name in out.stderr or cluster.nodes[0].address in out.stderr
        found = json.loads(out.stdout)  # ... the others had the whole history
        assert [event["kind"] for event in found] == ["launched", "stopped"]
        assert all(event["time"].endswith("Z") for event in found)
        assert found[0]["by"] == "train"
        assert found[1]["by"] == "stop"
        assert len({event["id"] for event in found}) == 2
        out = on_node(cluster, 2, workdir, "events", "--session", SESSION, "--since", "1h", env=env)
        assert out.returncode == 1, out.stdout + out.stderr
        table = out.stdout.splitlines()
        assert table[0].split()[:3] == ["time", "(UTC)", "kind"]
        assert [line.split()[2] for line in table[1:]] == ["launched", "stopped"]
    finally:
        sandbox.poweron(cluster, 0)
