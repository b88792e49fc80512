"""Issue 10, the mesh side: each case reproduced on real sshd nodes. Files sshd would refuse are
refused (never repaired), every hop checks host keys strictly, only served host keys are trusted,
concurrent edits survive, unmesh takes only its own mesh's lines, missing key halves are derived
and never overwritten, a dropped link fails that node within the timeout it names, dry runs write
nothing anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import fresh_sandbox, meshkit, named

from meshkit import sandbox
from meshkit.discovery import read_hosts
from meshkit.meshplan import mesh_id
from meshkit.ops import mesh as ops
from meshkit.outcome import PhaseEvent
from meshkit.remote import Settings

NODES = 3
FAST = {"MESHKIT_CONNECT_TIMEOUT": "3"}


@pytest.fixture
def lay():
    with fresh_sandbox(named("mhard"), NODES) as layout:
        yield layout


def ssh_dir(lay, i: int) -> Path:
    return lay.node_dir(lay.nodes[i]) / "ssh"


def snapshot(lay) -> dict[str, dict[str, tuple[bytes | str, int]]]:
    """Every node's ~/.ssh: each entry's bytes (or link target) and mode, read from the host."""
    out = {}
    for n in lay.nodes:
        d = lay.node_dir(n) / "ssh"
        out[n.name] = {
            p.name: (os.readlink(p) if p.is_symlink() else p.read_bytes(), p.lstat().st_mode)
            for p in sorted(d.iterdir())
        }
        out[n.name]["."] = (b"", d.stat().st_mode)
    return out


def mesh(lay, *args: str, hostfile: Path | str | None = None, env=None):
    return meshkit(
        "mesh", "--hostfile", str(hostfile or lay.hostfile), *args, env={**FAST, **(env or {})}
    )


def keygen(path: Path, comment: str = "user@site", kind: str = "ed25519") -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", comment, "-f", str(path)], check=True
    )


def settings(lay, **kw) -> Settings:
    return Settings(connect_timeout=3.0, ssh_configs=(str(lay.ssh_config),), **kw)


def can_log_in(lay, node, key: Path) -> bool:
    command = ["ssh", "-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes"]
    command += ["-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={lay.known_hosts}"]
    command += ["-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5"]
    command += [f"root@{node.address}", "true"]
    done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    return done.returncode == 0


# ---------------------------------------------------------------- 1. StrictModes


@pytest.mark.parametrize("case", ["mode666", "dir777", "symlink"])
def test_a_file_sshd_refuses_is_refused_never_repaired(lay, tmp_path, case):
    planted = tmp_path / "planted"
    keygen(planted, "planted")
    victim = lay.nodes[1]
    # The controller logs in with a key sshd reads from outside ~/.ssh (as a password would), so
    # that meshkit gets to see the refused file at all.
    etc = lay.node_dir(victim) / "etc_ssh"
    (etc / "bootstrap_keys").write_text(lay.key.with_suffix(".pub").read_text())
    (etc / "bootstrap_keys").chmod(0o600)
    conf = etc / "sshd_config"
    conf.write_text(
        "AuthorizedKeysFile .ssh/authorized_keys /etc/ssh/bootstrap_keys\n" + conf.read_text()
    )
    sandbox.reboot(lay, victim.index)
    auth = ssh_dir(lay, 1) / "authorized_keys"
    line = planted.with_suffix(".pub").read_text()
    if case == "symlink":
        other = Path(f"/var/tmp/meshkit-mhard-{os.getpid()}-elsewhere")
        other.write_text(auth.read_text() + line)
        os.chown(other, 4321, 4321)
        auth.unlink()
        auth.symlink_to(other)
    else:
        auth.write_text(auth.read_text() + line)
        if case == "mode666":
            auth.chmod(0o666)
        else:
            ssh_dir(lay, 1).chmod(0o777)
    try:
        before = snapshot(lay)
        assert not can_log_in(lay, victim, planted)  # sshd (StrictModes) ignores the file
        dry = mesh(lay, "--dry-run")
        assert dry.returncode != 0
        assert victim.address in dry.stderr
        expect = {
            "mode666": "~/.ssh/authorized_keys is writable by others (owner uid 0, mode 0666)",
            "dir777": "~/.ssh is writable by others (owner uid 0, mode 0777)",
            "symlink": "~/.ssh/authorized_keys is a symlink to "
            f"{other if case == 'symlink' else ''}",
        }[case]
        assert expect in dry.stderr
        assert "Traceback" not in dry.stderr
        out = mesh(lay)
        assert out.returncode != 0
        assert expect in out.stderr
        assert "no node was changed" in out.stderr
        assert snapshot(lay) == before
        out = mesh(lay, "--skip-unreachable", "--no-verify")
        assert out.returncode != 0
        assert f"left out: {victim.address}" in out.stdout + out.stderr
        assert snapshot(lay)["node1"] == before["node1"]  # nothing changed there, not even modes
        assert snapshot(lay)["node0"] != before["node0"]
        assert not can_log_in(lay, victim, planted)
        if case == "symlink":
            assert other.read_text().endswith(line)
            assert other.stat().st_uid == 4321
    finally:
        if case == "symlink":
            other.unlink()


# ---------------------------------------------------------------- 2. ProxyJump gateways


def jump_hostfile(lay, tmp_path) -> Path:
    """node2 reached only through node0 (ProxyJump), as a bastion setup would."""
    gw, target = lay.nodes[0], lay.nodes[2]
    conf = lay.ssh_config.read_text()
    (tmp_path / "ssh_config").write_text(
        f"Host behind\n  HostName {target.address}\n  ProxyJump root@{gw.address}\n"
        f"  User root\n  IdentityFile {lay.key}\n  UserKnownHostsFile {lay.known_hosts}\n" + conf
    )
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("behind\n")
    return hostfile


def test_proxyjump_gateway_host_key_is_checked_strictly(lay, tmp_path):
    hostfile = jump_hostfile(lay, tmp_path)
    good = lay.known_hosts.read_text()
    out = mesh(lay, "--no-verify", hostfile=hostfile)
    assert out.returncode == 0, out.stdout + out.stderr  # the route works with the right key
    assert meshkit("unmesh", "--hostfile", str(hostfile)).returncode == 0
    gw = lay.nodes[0].address
    impostor = tmp_path / "impostor"
    keygen(impostor)
    wrong = impostor.with_suffix(".pub").read_text().split()[:2]
    lay.known_hosts.write_text(
        "".join(
            f"{gw} {' '.join(wrong)}\n" if line.startswith(f"{gw} ssh-ed25519") else line + "\n"
            for line in good.splitlines()
            if not line.startswith(f"{gw} ecdsa")
        )
    )
    before = snapshot(lay)
    out = mesh(lay, "--no-verify", hostfile=hostfile)
    assert out.returncode != 0, out.stderr
    assert f"ProxyJump gateway {gw}: HOST KEY CHANGED" in out.stderr, out.stderr
    assert snapshot(lay) == before
    # Unknown to known_hosts altogether: refused too (fabric's AutoAddPolicy took it silently).
    lay.known_hosts.write_text(
        "".join(line + "\n" for line in good.splitlines() if not line.startswith(f"{gw} "))
    )
    out = mesh(lay, "--no-verify", hostfile=hostfile)
    assert out.returncode != 0
    assert f"ProxyJump gateway {gw}: unknown host key" in out.stderr
    assert snapshot(lay) == before


# ---------------------------------------------------------------- 3. served host keys only


def test_only_host_keys_sshd_serves_are_trusted_and_the_mesh_settles(lay):
    etc = lay.node_dir(lay.nodes[1]) / "etc_ssh"
    keygen(etc / "ssh_host_rsa_key", "root@node1", "rsa")  # present, never served (no HostKey)
    decoy = etc / "decoy"
    keygen(decoy, "root@node1", "ecdsa")
    shutil.copy(
        decoy.with_suffix(".pub"), etc / "ssh_host_ecdsa_key.pub"
    )  # not what sshd signs with
    out = mesh(lay)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ssh-rsa key SHA256:" in out.stdout
    assert "is not the one sshd serves" in out.stdout
    rsa = (etc / "ssh_host_rsa_key.pub").read_text().split()[1]
    fake = decoy.with_suffix(".pub").read_text().split()[1]
    served = (etc / "ssh_host_ed25519_key.pub").read_text().split()[1]
    for i in range(NODES):
        known = (ssh_dir(lay, i) / "known_hosts").read_text()
        assert rsa not in known
        assert fake not in known
        assert served in known
    again = mesh(lay)
    assert again.returncode == 0
    assert again.stdout.count("unchanged") == NODES  # it settles


# ---------------------------------------------------------------- 4. concurrent edits


def test_a_line_added_between_inspect_and_install_is_kept(lay, tmp_path):
    admin = tmp_path / "admin"
    keygen(admin, "admin@site")
    line = admin.with_suffix(".pub").read_text()
    hosts = read_hosts(lay.hostfile)

    def edit(event: PhaseEvent) -> None:
        if event.phase == "keys" and event.finished:  # after inspect, before install
            for i in range(NODES):
                auth = ssh_dir(lay, i) / "authorized_keys"
                auth.write_text(auth.read_text() + line)

    report = ops.mesh(hosts, settings(lay), mesh_id(hosts), progress=edit)
    assert report.ok, report
    assert all("merged again" in " ".join(n.notes) for n in report.nodes)
    for i in range(NODES):
        auth = (ssh_dir(lay, i) / "authorized_keys").read_text()
        assert line in auth
        assert auth.count(" meshkit:") == NODES
    assert can_log_in(lay, lay.nodes[1], admin)


def test_two_meshes_at_once_on_a_shared_node_lose_nothing(lay, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, nodes in ((a, lay.nodes[:2]), (b, lay.nodes[1:])):
        d.mkdir()
        (d / "hostfile").write_text("".join(f"{n.address}\n" for n in nodes))
        shutil.copy(lay.ssh_config, d / "ssh_config")
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    runs = [
        threading.Thread(
            target=lambda d=d: results.__setitem__(d.name, mesh(lay, hostfile=d / "hostfile"))
        )
        for d in (a, b)
    ]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert all(r.returncode == 0 for r in results.values()), results
    shared = (ssh_dir(lay, 1) / "authorized_keys").read_text()
    assert shared.count(" meshkit:") == NODES  # every key of both meshes, none lost
    known = (ssh_dir(lay, 1) / "known_hosts").read_text()
    assert all(n.address in known for n in lay.nodes)


# ---------------------------------------------------------------- 6. unmesh of one mesh only


def test_unmesh_takes_only_this_hostfiles_lines_and_keeps_keys_another_mesh_uses(lay, tmp_path):
    before = snapshot(lay)
    a, b = tmp_path / "a", tmp_path / "b"
    for d, nodes in ((a, lay.nodes[:2]), (b, lay.nodes[1:])):
        d.mkdir()
        (d / "hostfile").write_text("".join(f"{n.address}\n" for n in nodes))
        shutil.copy(lay.ssh_config, d / "ssh_config")
    assert mesh(lay, hostfile=a / "hostfile").returncode == 0
    assert mesh(lay, hostfile=b / "hostfile").returncode == 0
    key = (ssh_dir(lay, 1) / "id_ed25519").read_bytes()
    out = meshkit("unmesh", "--hostfile", str(a / "hostfile"))
    assert out.returncode == 0, out.stdout
    assert "another mesh still lists it" in out.stdout, out.stdout
    assert (ssh_dir(lay, 1) / "id_ed25519").read_bytes() == key
    assert snapshot(lay)["node0"] == before["node0"]
    check = meshkit("check", "--hostfile", str(b / "hostfile"))
    assert check.returncode == 0, check.stdout  # B still works
    assert meshkit("unmesh", "--hostfile", str(b / "hostfile")).returncode == 0
    assert snapshot(lay) == before


# ---------------------------------------------------------------- 8. key halves


def test_missing_public_half_is_derived_and_a_lone_pub_is_never_overwritten(lay):
    d1, d2 = ssh_dir(lay, 1), ssh_dir(lay, 2)
    keygen(d1 / "id_ed25519", "user@node1")
    private = (d1 / "id_ed25519").read_bytes()
    public = (d1 / "id_ed25519.pub").read_text()
    (d1 / "id_ed25519.pub").unlink()
    keygen(d2 / "id_ed25519", "token@node2")
    (d2 / "id_ed25519").unlink()  # private half held in an agent or a token
    lone = (d2 / "id_ed25519.pub").read_bytes()
    out = mesh(lay)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "derived" in out.stdout
    assert (d1 / "id_ed25519").read_bytes() == private
    assert (d1 / "id_ed25519.pub").read_text().split()[:2] == public.split()[:2]
    assert (d2 / "id_ed25519.pub").read_bytes() == lone
    assert not (d2 / "id_ed25519").exists()
    assert (d2 / "id_ecdsa").exists()  # a new key where no file was
    again = mesh(lay)
    assert again.returncode == 0
    assert again.stdout.count("unchanged") == NODES


# ---------------------------------------------------------------- 12. dropped link, temp files


def test_dropped_link_fails_that_node_within_its_timeout_and_stale_temps_are_cleaned(lay):
    for i in range(NODES):  # keys exist already: the next phase after inspect is install
        keygen(ssh_dir(lay, i) / "id_ed25519", f"user@node{i}")
    hosts = read_hosts(lay.hostfile)
    dead = lay.nodes[2]

    def drop(event: PhaseEvent) -> None:
        if event.phase == "inspect" and event.finished:
            subprocess.run(["ip", "link", "set", dead.veth, "down"], check=True)

    before = snapshot(lay)["node2"]
    try:
        report = ops.mesh(hosts, settings(lay, command_timeout=4.0), mesh_id(hosts), progress=drop)
    finally:
        subprocess.run(["ip", "link", "set", dead.veth, "up"], check=True)
    result = {n.host.host: n for n in report.nodes}
    assert result[dead.address].result == "failed"
    assert "install: no answer within 4s (command_timeout)" in (result[dead.address].error or "")
    assert result[lay.nodes[0].address].result == "changed"
    assert not report.ok
    assert snapshot(lay)["node2"] == before
    stale = ssh_dir(lay, 1) / ".authorized_keys.meshkit-0123456789ab"
    stale.write_text("half a write\n")
    out = mesh(lay)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not stale.exists()
    assert "removed 1 stale meshkit temp file" in out.stdout
    stale.write_text("half a write\n")
    assert meshkit("unmesh", "--hostfile", str(lay.hostfile)).returncode == 0
    assert not stale.exists()


# ---------------------------------------------------------------- principles


def test_known_hosts_lines_paramiko_cannot_parse_do_not_stop_connecting(lay, tmp_path):
    other = tmp_path / "other"
    keygen(other)
    pub = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    good = lay.known_hosts.read_text()
    lay.known_hosts.write_text(f"@cert-authority *.example.org {pub}\n@revoked * {pub}\n" + good)
    out = mesh(lay, "--no-verify")
    assert out.returncode == 0, out.stderr
    served = good.splitlines()[0].split(None, 1)[1]  # node0's ed25519 key, now revoked
    lay.known_hosts.write_text(f"@revoked * {served}\n" + good)
    out = mesh(lay, "--no-verify")
    assert out.returncode != 0
    assert "is REVOKED" in out.stderr


def test_dry_run_with_accept_new_writes_nothing_on_the_controller(lay, tmp_path):
    hostfile = tmp_path / "hostfile"
    shutil.copy(lay.hostfile, hostfile)
    env = {"HOME": str(tmp_path), "MESHKIT_IDENTITY": str(lay.key)}
    before = snapshot(lay)
    out = mesh(lay, "--dry-run", "--accept-new-host-keys", hostfile=hostfile, env=env)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / ".ssh").exists()
    assert snapshot(lay) == before


def test_an_authorized_keys_file_elsewhere_is_reported(lay):
    conf = lay.node_dir(lay.nodes[1]) / "etc_ssh" / "sshd_config"
    conf.write_text("AuthorizedKeysFile /etc/ssh/authorized/%u\n" + conf.read_text())
    before = snapshot(lay)
    out = mesh(lay)
    assert out.returncode != 0
    assert "sshd reads AuthorizedKeysFile /etc/ssh/authorized/%u" in out.stderr
    assert snapshot(lay) == before
