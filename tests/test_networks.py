"""The sandbox's real-world networks: second network, per-node interface names, docker0 everywhere,
the Debian 127.0.1.1 line, and a link that can be cut and mended."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import meshkit, named, need_root, sandbox_dir

from meshkit import sandbox
from meshkit.errors import SandboxError
from meshkit.sandbox import networks

NAME = named("network")


def test_options_parse_and_round_trip_through_state():
    assert networks.NetworkOptions.parse("") == networks.NetworkOptions()
    assert networks.NetworkOptions.parse("all") == networks.NetworkOptions.all()
    opts = networks.NetworkOptions.parse("docker0, debian-hosts")
    assert opts == networks.NetworkOptions(docker=True, debian_hosts=True)
    assert networks.NetworkOptions.from_state(opts.as_state()) == opts
    with pytest.raises(SandboxError, match="unknown wifi"):
        networks.NetworkOptions.parse("second,wifi")


def test_names_differ_per_node_and_second_subnet_is_derived():
    lay = sandbox.layout("/var/tmp/x", "10.77.5.0/24", 4, "nx", networks.NetworkOptions.all())
    assert [networks.primary_ifname(lay.networks, i) for i in range(4)] == [
        "eth0",
        "ens3",
        "eno1",
        "eth0",
    ]
    assert str(networks.second_subnet(lay)) == "10.78.5.0/24"
    assert networks.second_address(lay, lay.nodes[2]) == "10.78.5.13"
    text = networks.hosts_text(lay, lay.nodes[1])
    assert text.splitlines()[:2] == ["127.0.0.1 localhost", "127.0.1.1 node1"]
    plain = sandbox.layout("/var/tmp/x", "10.77.5.0/24", 2, "nx")
    assert networks.primary_ifname(plain.networks, 1) == "eth0"
    assert "127.0.1.1" not in networks.hosts_text(plain, plain.nodes[0])


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    need_root()
    path = sandbox_dir(NAME)
    out = meshkit("sandbox.up", "--nodes", "3", "--name", NAME, "--dir", path, "--networks", "all")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "networks:    second, ifnames, docker, debian_hosts" in out.stdout
    try:
        yield sandbox.load(path)
    finally:
        sandbox.down(path, NAME)


def addresses(lay: sandbox.Layout, node: sandbox.Node) -> dict[str, list[str]]:
    out = sandbox.node_exec(node, ["ip", "-j", "-4", "addr", "show"])
    return {
        link["ifname"]: [address["local"] for address in link["addr_info"]]
        for link in json.loads(out.stdout)
    }


PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 22), timeout=3).close()
    print("open")
except ConnectionRefusedError:
    print("refused")  # the host answered: reachable
except OSError as exc:
    print("unreachable", exc)
"""


def ping(lay: sandbox.Layout, frm: int, to: str) -> bool:
    """Whether node ``frm`` reaches address ``to`` over TCP (an answer, even a refusal, counts)."""
    out = sandbox.node_exec(lay.nodes[frm], [sys.executable, "-c", PROBE, to], timeout=15)
    return out.stdout.split()[:1] in (["open"], ["refused"])


def test_every_node_has_its_networks_and_the_state_keeps_them(lay):
    assert lay.networks == networks.NetworkOptions.all()
    for node, (first, second) in zip(
        lay.nodes, [("eth0", "eth1"), ("ens3", "ens4"), ("eno1", "eno2")]
    ):
        found = addresses(lay, node)
        assert found[first] == [node.address]
        assert found[second] == [networks.second_address(lay, node)]
        assert found["docker0"] == ["172.17.0.1"]
        assert found["lo"] == ["127.0.0.1"]
        hosts = sandbox.node_exec(node, ["getent", "hosts", node.name]).stdout.split()
        assert hosts[0] == "127.0.1.1"  # the Debian trap: its own name is loopback
        other = lay.nodes[(node.index + 1) % lay.count]
        assert sandbox.node_exec(node, ["getent", "hosts", other.name]).stdout.split()[0] == (
            other.address
        )
    # both networks carry traffic between nodes
    assert ping(lay, 0, lay.nodes[1].address)
    assert ping(lay, 0, networks.second_address(lay, lay.nodes[1]))


def test_cut_takes_one_link_down_both_ways_and_mend_restores_it(lay):
    out = meshkit("sandbox.cut", "--node", "0", "--peer", "2", "--dir", sandbox_dir(NAME))
    assert out.returncode == 0, out.stderr
    try:
        assert networks.cuts(lay) == [(0, 2)]
        assert not ping(lay, 0, lay.nodes[2].address)
        assert not ping(lay, 2, lay.nodes[0].address)
        assert not ping(lay, 2, networks.second_address(lay, lay.nodes[0]))
        assert ping(lay, 0, lay.nodes[1].address) and ping(lay, 1, lay.nodes[2].address)
    finally:
        out = meshkit("sandbox.mend", "--node", "0", "--peer", "2", "--dir", sandbox_dir(NAME))
    assert out.returncode == 0, out.stderr
    assert networks.cuts(lay) == []
    assert ping(lay, 0, lay.nodes[2].address) and ping(lay, 2, lay.nodes[0].address)
    bad = meshkit("sandbox.cut", "--node", "0", "--peer", "7", "--dir", sandbox_dir(NAME))
    assert bad.returncode == 1 and "node 7: the sandbox has nodes 0..2" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_rebooted_node_keeps_its_networks(lay):
    again = sandbox.load(sandbox_dir(NAME))  # options come back from state.json
    assert again.networks == networks.NetworkOptions.all()
    sandbox.reboot(again, 1)
    found = addresses(again, again.nodes[1])
    assert found["ens3"] == [again.nodes[1].address] and found["docker0"] == ["172.17.0.1"]
    hosts = sandbox.node_exec(again.nodes[1], ["getent", "hosts", "node1"]).stdout.split()
    assert hosts[0] == "127.0.1.1"


def test_mesh_accepts_the_same_docker0_address_on_every_node(lay):
    """docker0 (172.17.0.1 on every node) is left out of known_hosts with a note, not a conflict
    that would stop every Docker cluster; the pairs then all log in."""
    out = meshkit("mesh", "--hostfile", str(lay.hostfile))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "172.17.0.1" in out.stdout + out.stderr  # named as left out, not silently dropped


def test_down_removes_the_second_network(lay):
    # (runs last in this module: the fixture's down would do the same)
    sandbox.down(sandbox_dir(NAME), NAME)
    shown = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    links = json.loads(shown.stdout)
    names = {link["ifname"] for link in links}
    assert lay.second_bridge not in names
    assert not any(lay.owns_veth(n) for n in names)  # either network's veths
