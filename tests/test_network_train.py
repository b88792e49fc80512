"""Training on real-world networks: per-node interface names, a second network, docker0 on every
node and Debian's ``127.0.1.1 <hostname>`` line. A bare torchrun gloo all_reduce started by
``meshkit train`` completes on every node with the exported interface, and fails (bounded) without
it: gloo then binds what the hostname resolves to, 127.0.1.1, or the docker0 address every node
shares."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import meshkit, named, need_root, sandbox_dir

from meshkit import sandbox, templates
from meshkit.sandbox import networks

NAME = named("nmulti")
IFNAMES = ["eth0", "ens3", "eno1"]
PROBE = re.compile(r"meshkit-probe rank=(\d+) (.*)")


@pytest.fixture(scope="module")
def meshed() -> Iterator[tuple[sandbox.Layout, Path]]:
    need_root()
    path = sandbox_dir(NAME)
    opts = networks.NetworkOptions(second=True, ifnames=True, debian_hosts=True)
    lay = sandbox.up(path, sandbox.default_subnet("", NAME), 3, NAME, networks=opts)
    try:
        out = meshkit("mesh", "--hostfile", str(lay.hostfile), "--no-verify")
        assert out.returncode == 0, out.stdout + out.stderr
        # docker0 after the mesh: mesh refuses the address every node shares (see test_networks)
        networks.add_docker(lay)
        workdir = lay.shared / "work"
        workdir.mkdir()
        templates.copy_to("collective_probe.py", workdir)
        (workdir / "names").write_text("".join(f"{n.name}\n" for n in lay.nodes))
        yield lay, workdir
    finally:
        sandbox.down(path, NAME)


def on_node(lay, index: int, workdir: Path, *args: str, env: str = "", timeout: float = 300):
    argv = [sys.executable, "-m", "meshkit", *args]
    line = f"cd {shlex.quote(str(workdir))} && {env} {shlex.join(argv)}"
    return sandbox.node_exec(lay.nodes[index], ["bash", "-c", line], timeout=timeout)


def env_json(lay, index: int, workdir: Path, hostfile: Path, env: str = "") -> dict[str, str]:
    out = on_node(lay, index, workdir, "env", "--json", "--hostfile", str(hostfile), env=env)
    assert out.returncode == 0, out.stderr
    data: dict[str, str] = json.loads(out.stdout)
    return data


def test_each_node_exports_its_own_interface_name(meshed):
    lay, workdir = meshed
    for i, node in enumerate(lay.nodes):
        found = env_json(lay, i, workdir, lay.hostfile)
        assert found["GLOO_SOCKET_IFNAME"] == found["NCCL_SOCKET_IFNAME"] == IFNAMES[i]
        assert (
            found["interface_source"]
            == f"hostfile: {node.address} on {IFNAMES[i]} placed this node"
        )
        # with the Debian line, a node's own name is loopback there ...
        own = sandbox.node_exec(node, ["getent", "hosts", node.name]).stdout.split()
        assert own[0] == "127.0.1.1"
        # ... yet a hostfile of names places it by its real address and interface
        by_name = env_json(lay, i, workdir, workdir / "names")
        assert (by_name["NODE_RANK"], by_name["GLOO_SOCKET_IFNAME"]) == (str(i), IFNAMES[i])
        assert by_name["matched"] == f"{node.address} on {IFNAMES[i]}"


def test_launcher_sources_take_the_interface_of_the_route_to_master_addr(meshed):
    lay, workdir = meshed
    # MASTER_ADDR node0 is 127.0.1.1 on node0 itself: the loopback answer never decides
    for i in range(lay.count):
        found = env_json(lay, i, workdir, workdir / "names", env=f"MESHKIT_NODE_RANK={i}")
        assert found["source"] == "explicit"
        assert found["MASTER_ADDR"] == "node0"
        assert found["GLOO_SOCKET_IFNAME"] == IFNAMES[i], found
        master = lay.nodes[0].address
        route = f"route: MASTER_ADDR node0 ({master}) is reached from {lay.nodes[i].address}"
        assert found["interface_source"].startswith(route)
    # the user's own setting is kept (and said so)
    found = env_json(lay, 1, workdir, lay.hostfile, env="NCCL_SOCKET_IFNAME=^docker0,lo")
    assert (found["GLOO_SOCKET_IFNAME"], found["NCCL_SOCKET_IFNAME"]) == ("ens3", "^docker0,lo")
    assert found["interface_source"].startswith("NCCL_SOCKET_IFNAME already set: kept; hostfile:")


def status(lay, workdir: Path, session: str) -> list[dict[str, object]]:
    out = on_node(lay, 0, workdir, "status", "--session", session, "--json")
    assert out.returncode == 0, out.stderr
    rows: list[dict[str, object]] = json.loads(out.stdout)
    return rows


def finished(lay, workdir: Path, session: str, timeout: float = 480) -> list[dict[str, object]]:
    """Every node's row once all have exited (polled, bounded). Status is asked once every rank
    printed its probe line (right before it ends), else every 10 s: the logs are cheap to read,
    a status round costs about a second of CPU, and a failing probe waits out gloo's connect
    timeout."""
    deadline = time.monotonic() + timeout
    asked = time.monotonic()
    while time.monotonic() < deadline:
        every_rank_said = len(probe_lines(workdir, session, lay.count)) == lay.count
        if every_rank_said or time.monotonic() - asked >= 10:
            asked = time.monotonic()
            rows = status(lay, workdir, session)
            if all(row["state"] == "exited" for row in rows):
                return rows
        time.sleep(1)
    rows = status(lay, workdir, session)
    raise AssertionError(f"{session}: not all nodes exited within {timeout}s: {rows}")


def probe_lines(workdir: Path, session: str, nodes: int) -> dict[int, str]:
    found = {}
    for rank in range(nodes):
        log = workdir / ".meshkit" / session / f"node{rank}.log"
        text = log.read_text() if log.exists() else ""
        for match in PROBE.finditer(text):
            found[int(match.group(1))] = match.group(2)
    return found


def train(lay, workdir: Path, session: str, cmd: str):
    out = on_node(
        lay,
        1,
        workdir,
        "train",
        "--hostfile",
        str(lay.hostfile),
        "--session",
        session,
        "--nproc-per-node",
        "1",
        "--cmd",
        cmd,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_bare_torchrun_gloo_all_reduce_completes_with_the_exported_interface(meshed):
    lay, workdir = meshed
    train(lay, workdir, "good", "torchrun collective_probe.py --backend gloo --timeout 60")
    rows = finished(lay, workdir, "good")
    lines = probe_lines(workdir, "good", lay.count)
    assert [r["exit_code"] for r in rows] == [0] * lay.count, lines
    for rank in range(lay.count):
        assert (
            f"backend=gloo ifname={IFNAMES[rank]} host=node{rank} sum=6 expected=6 ok=True"
            in (lines[rank])
        )


@pytest.mark.parametrize(
    ("session", "override", "advertised"),
    [
        # gloo falls back to the hostname: 127.0.1.1 on every node
        ("unset", "env -u GLOO_SOCKET_IFNAME -u NCCL_SOCKET_IFNAME", "127.0.1.1"),
        # one name for all nodes, the wrong one: every node advertises 172.17.0.1
        ("docker", "env GLOO_SOCKET_IFNAME=docker0", "172.17.0.1"),
    ],
)
def test_without_the_right_interface_the_same_job_fails_bounded(
    meshed, session, override, advertised
):
    lay, workdir = meshed
    train(
        lay, workdir, session, f"{override} torchrun collective_probe.py --backend gloo --timeout 8"
    )
    rows = finished(lay, workdir, session)
    lines = probe_lines(workdir, session, lay.count)
    assert all(r["exit_code"] != 0 for r in rows), (rows, lines)
    assert lines, lines
    assert all("error=" in line for line in lines.values()), lines
    assert not any("ok=True" in line for line in lines.values())
    # gloo's own words: a peer tried the address every node shares, e.g.
    # "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:25517"
    assert any(f"remote=[{advertised}]" in line for line in lines.values()), lines
