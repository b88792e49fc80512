"""Every name a node answers to is in known_hosts: after mesh with an address hostfile and with a
name hostfile, real clients run from inside the nodes by names and by addresses: OpenMPI's mpirun,
pdsh over ssh, and plain OpenSSH with BatchMode and strict host keys by every recorded name."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from conftest import fresh_sandbox, meshkit, named

from meshkit import sandbox

NODES = 3
FAST = {"MESHKIT_CONNECT_TIMEOUT": "5"}


@pytest.fixture
def lay():
    with fresh_sandbox(named("mnames"), NODES) as layout:
        yield layout


def name_hostfile(lay) -> str:
    """node0.. as the hostfile spells them; the sandbox ssh_config beside it maps each to its
    address with HostName (the controller cannot resolve node<i> any other way)."""
    path = lay.root / "hostfile.names"
    path.write_text("".join(f"{n.name}\n" for n in lay.nodes))
    return str(path)


def ssh_files(lay) -> dict[str, dict[str, bytes]]:
    return {
        n.name: {p.name: p.read_bytes() for p in sorted((lay.node_dir(n) / "ssh").iterdir())}
        for n in lay.nodes
    }


def recorded_names(lay, node) -> set[str]:
    names = set()
    for line in (lay.node_dir(node) / "ssh" / "known_hosts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3] == "meshkit":
            names |= set(fields[0].split(","))
    return names


def inside(node, *argv: str, timeout: float = 60):
    out = sandbox.node_exec(node, list(argv), timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def clients_work(lay) -> None:
    names = [n.name for n in lay.nodes]
    addresses = [n.address for n in lay.nodes]
    for src in (lay.nodes[0], lay.nodes[2]):  # two different nodes
        for hosts in (names, addresses):
            code, out, err = inside(
                src, "mpirun", "--allow-run-as-root", "-H", ",".join(hosts), "-np", str(NODES),
                "hostname",
            )  # fmt: skip
            assert code == 0, (src.name, hosts, out, err)
            assert sorted(out.split()) == names, (src.name, hosts, out)
            code, out, err = inside(src, "pdsh", "-R", "ssh", "-w", ",".join(hosts), "hostname")
            assert code == 0, (src.name, hosts, err)
            assert "verification failed" not in err, (src.name, hosts, err)
            got = dict(line.split(": ", 1) for line in out.splitlines())
            assert got == dict(zip(hosts, names)), (src.name, out, err)
        recorded = recorded_names(lay, src)
        assert set(names) | set(addresses) <= recorded
        for name in sorted(recorded):
            code, out, err = inside(
                src, "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", "ConnectTimeout=5", name, "hostname",
            )  # fmt: skip
            assert code == 0, (src.name, name, err)
            owner = next(n for n in lay.nodes if name in (n.name, n.address))
            assert out.strip() == owner.name


def test_address_hostfile_then_every_client_by_names_and_addresses(lay):
    before = ssh_files(lay)
    out = meshkit("mesh", "--hostfile", str(lay.hostfile), env=FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        f"{lay.nodes[1].address} answers to: {lay.nodes[1].address} (hostfile), node1" in out.stdout
    )
    clients_work(lay)
    again = meshkit("mesh", "--hostfile", str(lay.hostfile), "--no-verify", env=FAST)
    assert again.returncode == 0
    assert again.stdout.count("unchanged") == NODES
    data = json.loads(meshkit("check", "--hostfile", str(lay.hostfile), "--json").stdout)
    assert data["ok"], data
    assert meshkit("unmesh", "--hostfile", str(lay.hostfile)).returncode == 0
    assert ssh_files(lay) == before


def test_name_hostfile_then_every_client_by_names_and_addresses(lay):
    hostfile = name_hostfile(lay)
    before = ssh_files(lay)
    out = meshkit("mesh", "--hostfile", hostfile, env=FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"node1 answers to: node1 (hostfile), {lay.nodes[1].address} (ssh_config HostName)" in (
        out.stdout
    )
    clients_work(lay)
    assert meshkit("unmesh", "--hostfile", hostfile).returncode == 0
    assert ssh_files(lay) == before


def test_both_hostfiles_share_lines_and_each_unmesh_leaves_the_other(lay):
    before = ssh_files(lay)
    hostfile = name_hostfile(lay)
    assert meshkit("mesh", "--hostfile", str(lay.hostfile), "--no-verify", env=FAST).returncode == 0
    out = meshkit("mesh", "--hostfile", hostfile, "--no-verify", env=FAST)
    assert out.returncode == 0
    assert "~" in out.stdout  # the same lines, now listing both meshes
    assert meshkit("unmesh", "--hostfile", str(lay.hostfile)).returncode == 0
    clients_work(lay)  # the name mesh still works: its lines and keys stayed
    assert meshkit("unmesh", "--hostfile", hostfile).returncode == 0
    assert ssh_files(lay) == before


def test_a_name_two_nodes_claim_is_a_conflict_before_anything_is_written(lay):
    before = ssh_files(lay)
    code, _, err = inside(lay.nodes[2], "hostname", "node1")
    assert code == 0, err
    out = meshkit("mesh", "--hostfile", str(lay.hostfile), env=FAST)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "name 'node1' is claimed by" in out.stderr
    assert "nothing was written" in out.stderr
    assert ssh_files(lay) == before


def test_check_tries_every_pair_by_hostname_too(lay):
    assert meshkit("mesh", "--hostfile", str(lay.hostfile), "--no-verify", env=FAST).returncode == 0
    # node2 renamed after the mesh: its new hostname is neither resolvable nor recorded.
    assert inside(lay.nodes[2], "hostname", "renamed2")[0] == 0
    out = meshkit("check", "--hostfile", str(lay.hostfile), "--json", env=FAST)
    data = json.loads(out.stdout)
    assert out.returncode == 1
    assert not data["ok"]
    assert {(f["to"], "by hostname renamed2" in f["error"]) for f in data["failures"]} == {
        (lay.nodes[2].address, True)
    }
    assert len(data["failures"]) == NODES


def test_custom_port_names_are_bracketed(lay, tmp_path):
    """A node reached off port 22 is recorded as [name]:port under each of its names."""
    node = lay.nodes[1]
    conf = lay.node_dir(node) / "etc_ssh" / "sshd_config"
    conf.write_text(conf.read_text().replace("Port 22\n", "Port 22\nPort 2222\n"))
    sandbox.reboot(lay, node.index)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{lay.nodes[0].address}\n{node.address}:2222\n")
    shutil.copy(lay.ssh_config, tmp_path / "ssh_config")
    known = lay.known_hosts.read_text()
    key = next(line for line in known.splitlines() if line.startswith(node.address + " "))
    lay.known_hosts.write_text(
        known + key.replace(node.address, f"[{node.address}]:2222", 1) + "\n"
    )
    out = meshkit("mesh", "--hostfile", str(hostfile), env=FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    names = recorded_names(lay, lay.nodes[0])
    assert {f"[{node.address}]:2222", "[node1]:2222"} <= names
    code, out_, err = inside(
        lay.nodes[0], "ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-p", "2222", "node1", "hostname",
    )  # fmt: skip
    assert code == 0, err
    assert out_.strip() == "node1", err


def test_an_address_every_node_has_on_a_local_bridge_is_recorded_for_none(lay):
    """docker0 has the same address on every node: it names none of them, and stops nothing."""
    for n in lay.nodes[:2]:
        for cmd in (
            "link add mkdock0 type bridge",
            "addr add 172.31.250.1/24 dev mkdock0",
            "link set mkdock0 up",
        ):
            subprocess.run(["ip", "-n", n.netns, *cmd.split()], check=True)
    out = meshkit("mesh", "--hostfile", str(lay.hostfile), env=FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "address 172.31.250.1 is on 2 nodes" in out.stdout
    for n in lay.nodes:
        assert "172.31.250.1" not in recorded_names(lay, n)
