"""mesh / check / unmesh against real sshd nodes. Each test gets a fresh sandbox (~0.3s)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import fresh_sandbox, meshkit, named

from meshkit import sandbox

NODES = 4
FAST = {"MESHKIT_CONNECT_TIMEOUT": "3"}


@pytest.fixture
def lay():
    with fresh_sandbox(named("mesh"), NODES) as layout:
        yield layout


def ssh_files(lay) -> dict[str, dict[str, bytes]]:
    """Every node's ~/.ssh, read from the host side (the nodes' private dirs)."""
    return {
        n.name: {p.name: p.read_bytes() for p in sorted((lay.node_dir(n) / "ssh").iterdir())}
        for n in lay.nodes
    }


def all_pairs_from_inside(lay) -> list[tuple[str, str]]:
    """Plain OpenSSH from inside every node to every node; the pairs that fail."""
    failed = []
    for src in lay.nodes:
        for dst in lay.nodes:
            out = sandbox.node_exec(
                src,
                [
                    "ssh",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "StrictHostKeyChecking=yes",
                    "-o",
                    "ConnectTimeout=5",
                    dst.address,
                    "hostname",
                ],
            )
            if out.returncode != 0 or out.stdout.strip() != dst.name:
                failed.append((src.name, dst.name))
    return failed


def mesh(lay, *args, timeout=180):
    return meshkit("mesh", "--hostfile", str(lay.hostfile), *args, env=FAST, timeout=timeout)


def test_mesh_makes_every_pair_work_reruns_change_nothing_and_unmesh_restores(lay):
    admin = (
        'from="10.0.0.0/8",no-pty ssh-ed25519 '
        "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl admin@site\n"
    )
    for n in lay.nodes:
        path = lay.node_dir(n) / "ssh" / "authorized_keys"
        path.write_text(path.read_text() + admin)
    before = ssh_files(lay)
    assert len(all_pairs_from_inside(lay)) == NODES * NODES

    out = mesh(lay)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"verify: {NODES * NODES}/{NODES * NODES} pairs log in" in out.stdout
    assert all_pairs_from_inside(lay) == []
    after = ssh_files(lay)
    for n in lay.nodes:
        auth = after[n.name]["authorized_keys"]
        assert auth.startswith(
            before[n.name]["authorized_keys"]
        )  # the admin's lines, byte for byte
        assert auth.count(b" meshkit:") == NODES
        assert (lay.node_dir(n) / "ssh").stat().st_mode & 0o777 == 0o700
        for name in ("authorized_keys", "known_hosts", "id_ed25519"):
            assert (lay.node_dir(n) / "ssh" / name).stat().st_mode & 0o777 == 0o600

    again = mesh(lay)
    assert again.returncode == 0
    assert "unchanged" in again.stdout
    assert ssh_files(lay) == after

    out = meshkit("unmesh", "--hostfile", str(lay.hostfile))
    assert out.returncode == 0, out.stderr
    assert ssh_files(lay) == before


def test_check_json_before_and_after(lay):
    out = meshkit("check", "--hostfile", str(lay.hostfile), "--json")
    data = json.loads(out.stdout)
    assert out.returncode != 0
    assert not data["ok"]
    assert len(data["failures"]) == NODES * NODES
    assert data["nodes"] == [n.address for n in lay.nodes]
    assert set(data["failures"][0]) == {"from", "to", "error"}
    assert mesh(lay, "--no-verify").returncode == 0
    data = json.loads(meshkit("check", "--hostfile", str(lay.hostfile), "--json").stdout)
    assert data == {"nodes": [n.address for n in lay.nodes], "ok": True, "failures": []}


def test_dry_run_changes_nothing(lay):
    before = ssh_files(lay)
    out = mesh(lay, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "would add" in out.stdout
    assert "create" in out.stdout
    assert ssh_files(lay) == before


def test_controller_logs_in_exactly_once_per_node(lay):
    for n in lay.nodes:
        lay.sshd_log(n).write_text("")
    assert mesh(lay).returncode == 0
    for n in lay.nodes:
        log = lay.sshd_log(n).read_text()
        from_controller = re.findall(
            rf"Accepted publickey for root from {re.escape(lay.controller_address)} ", log
        )
        assert len(from_controller) == 1, (n.name, log)


def test_a_dead_node_means_no_node_changes(lay):
    before = ssh_files(lay)
    subprocess.run(["ip", "link", "set", lay.nodes[2].veth, "down"], check=True)
    out = mesh(lay, timeout=60)
    assert out.returncode != 0
    assert f"{lay.nodes[2].address}: no answer within 3s" in out.stderr
    assert "no node was changed" in out.stderr
    assert "Traceback" not in out.stderr
    assert ssh_files(lay) == before

    out = mesh(lay, "--skip-unreachable", timeout=60)
    assert out.returncode != 0
    assert f"left out: {lay.nodes[2].address}" in out.stderr
    assert ssh_files(lay)["node2"] == before["node2"]
    assert ssh_files(lay)["node1"] != before["node1"]

    out = meshkit("check", "--hostfile", str(lay.hostfile), "--json")
    down = lay.nodes[2].address
    why = f"controller cannot use {down}: no answer within 10s on port 22: is the node up"
    failures = json.loads(out.stdout)["failures"]
    assert out.returncode == 1
    assert [f["to"] for f in failures if f["from"] == down] == [n.address for n in lay.nodes]
    assert all(f["error"].startswith(why) for f in failures if f["from"] == down), failures


def test_stopped_sshd_is_reported_per_host(lay):
    sandbox.kill_node(lay.nodes[1].netns)
    out = mesh(lay)
    assert out.returncode != 0
    assert f"{lay.nodes[1].address}: connection refused on port 22" in out.stderr


def test_hostile_key_comment_is_data_never_shell(lay):
    ssh_dir = lay.node_dir(lay.nodes[1]) / "ssh"
    subprocess.run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-f",
            str(ssh_dir / "id_ed25519"),
            "-C",
            "$(touch /var/tmp/meshkit-pwned) `touch /var/tmp/meshkit-pwned2`; rm -rf /",
        ],
        check=True,
    )
    assert mesh(lay).returncode == 0
    assert not Path("/var/tmp/meshkit-pwned").exists()
    assert not Path("/var/tmp/meshkit-pwned2").exists()
    for n in lay.nodes:
        assert b"touch" not in (lay.node_dir(n) / "ssh" / "authorized_keys").read_bytes()
    hostile = lay.root / "hostile"
    hostile.write_text(
        f"{lay.nodes[0].address}\n{lay.nodes[1].address};touch /var/tmp/meshkit-pwned3\n"
    )
    out = meshkit("mesh", "--hostfile", str(hostile))
    assert out.returncode != 0
    assert "hostile:2: bad host" in out.stderr
    assert not Path("/var/tmp/meshkit-pwned3").exists()


def test_changed_host_key_is_refused(lay):
    before = ssh_files(lay)
    victim = lay.nodes[3]
    key = lay.node_dir(victim) / "etc_ssh" / "ssh_host_ed25519_key"
    key.unlink()
    key.with_suffix(".pub").unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    sandbox.reboot(lay, victim.index)
    out = mesh(lay)
    assert out.returncode != 0
    assert f"{victim.address}: HOST KEY CHANGED" in out.stderr
    assert "ssh-keygen -R" in out.stderr
    assert ssh_files(lay) == before


def test_unknown_host_key_is_refused_with_fingerprint_then_accepted(lay, tmp_path):
    hostfile = tmp_path / "hostfile"  # no ssh_config beside it: nothing known about the nodes
    shutil.copy(lay.hostfile, hostfile)
    env = {"HOME": str(tmp_path), "MESHKIT_IDENTITY": str(lay.key)}
    out = meshkit("mesh", "--hostfile", str(hostfile), env=env)
    assert out.returncode != 0
    assert "unknown host key ssh-ed25519 SHA256:" in out.stderr
    assert "--accept-new-host-keys" in out.stderr
    out = meshkit("mesh", "--hostfile", str(hostfile), "--accept-new-host-keys", env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / ".ssh" / "known_hosts").read_text().count("ssh-ed25519") == NODES


def test_shared_home_ends_correct(lay):
    """node1 and node2 share one ~/.ssh (as on NFS homes): both write the same files at once."""
    shared = lay.node_dir(lay.nodes[1]) / "ssh"
    own = lay.node_dir(lay.nodes[2]) / "ssh"
    shutil.rmtree(own)
    own.symlink_to(shared)
    sandbox.reboot(lay, 2)
    out = mesh(lay)
    assert out.returncode == 0, out.stdout + out.stderr
    assert all_pairs_from_inside(lay) == []
    auth = (shared / "authorized_keys").read_text()
    assert auth.count(" meshkit:") == NODES - 1  # node1 and node2 share one user key
    assert mesh(lay).returncode == 0
    assert "unchanged" in mesh(lay).stdout


def test_one_shell_per_node_and_host_keys_proven_in_the_connection(lay):
    """Every shell sshd starts for a node (exec channels and, with sftp-server, the SFTP
    subsystem) runs the user's ~/.bashrc: conda or pyenv init costs ~0.1 s of CPU each on many
    ML nodes. mesh --no-verify starts one per node, as one `ssh node true` does; mesh's verify
    adds one login per ordered pair (its other names get a host-key check, with no shell)."""
    for n in lay.nodes:
        conf = lay.node_dir(n) / "etc_ssh" / "sshd_config"
        conf.write_text(conf.read_text().replace("internal-sftp", "/usr/lib/openssh/sftp-server"))
        sandbox.reboot(lay, n.index)
        (lay.node_dir(n) / "bashrc").write_text(
            'printf "%s\\n" "${BASH_EXECUTION_STRING%%[[:space:]]*}" >> /tmp/shells\n'
        )

    def shells() -> list[int]:
        counts = []
        for n in lay.nodes:
            path = lay.node_dir(n) / "tmp" / "shells"
            counts.append(len(path.read_text().splitlines()) if path.exists() else 0)
            path.write_text("")
        return counts

    out = mesh(lay, "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    assert shells() == [1] * NODES
    assert re.search(
        r"host keys proven in the connection \(hostkeys-prove-00@openssh.com\): "
        + ", ".join(re.escape(n.address) for n in lay.nodes),
        out.stdout,
    ), out.stdout
    out = mesh(lay)
    assert out.returncode == 0, out.stdout + out.stderr
    assert shells() == [1 + NODES] * NODES
    assert "pass the host-key check by hostname (key exchange only" in out.stdout
    out = meshkit("unmesh", "--hostfile", str(lay.hostfile))
    assert out.returncode == 0, out.stdout + out.stderr
    assert shells() == [1] * NODES
