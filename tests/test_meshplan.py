"""The mesh's pure logic, without mocks: user-key choice, names and conflicts, refused files,
AuthorizedKeysFile, plans and unmesh plans across two meshes."""

from __future__ import annotations

import base64
import hashlib
import stat
import struct

import pytest

from meshkit import meshplan as mp
from meshkit.errors import KeyFormatError
from meshkit.hostfile import Host
from meshkit.keys import PublicKey, parse_public_key


def make_key(seed: str, comment: str = "c", kind: str = "ssh-ed25519") -> PublicKey:
    raw = struct.pack(">I", len(kind)) + kind.encode() + struct.pack(">I", 32)
    raw += hashlib.sha256(seed.encode()).digest()
    return PublicKey(kind, base64.b64encode(raw).decode(), comment)


def line(k: PublicKey) -> str:
    return f"{k.kind} {k.blob} {k.comment}"


def facts(host: Host, seed: str, names, user=True, authorized="", known="") -> mp.NodeFacts:
    key = make_key("u" + seed, "meshkit-generated@" + host.label) if user else None
    return mp.NodeFacts(
        host,
        mp.UserKey("kept" if user else "generate", ".ssh/id_ed25519", key),
        (make_key("h" + seed),),
        tuple((n, "hostfile") for n in names),
        authorized,
        known,
    )


def test_mesh_id_depends_on_the_nodes_only():
    a = [Host("n1"), Host("n0", lineno=3)]
    assert mp.mesh_id(a) == mp.mesh_id([Host("N0"), Host("n1")])
    assert mp.mesh_id(a) != mp.mesh_id([Host("n0")])
    assert len(mp.mesh_id(a)) == 10


def test_user_key_choice_derives_and_never_overwrites():
    k = make_key("k")
    kept = mp.choose_user_key([mp.KeySlot(".ssh/id_ed25519", True, line(k))], "n")
    assert kept.action == "kept"
    assert kept.key == k
    derive = mp.choose_user_key([mp.KeySlot(".ssh/id_rsa", True, None)], "n")
    assert (derive.action, derive.path) == ("derive", ".ssh/id_rsa")
    lone = mp.choose_user_key([mp.KeySlot(".ssh/id_ed25519", False, line(k))], "n")
    assert (lone.action, lone.path) == ("generate", ".ssh/id_ecdsa")
    with pytest.raises(KeyFormatError, match="never overwrites"):
        mp.choose_user_key(
            [mp.KeySlot(p, False, line(k)) for p in (".ssh/id_ed25519", ".ssh/id_ecdsa")], "n"
        )


def test_names_addresses_and_hostnames():
    fib = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 10.1.0.5
        /32 host LOCAL
     |-- 127.0.0.1
        /32 host LOCAL
     |-- 10.1.0.255
        /32 link BROADCAST
"""
    assert mp.parse_fib_trie(fib) == ["10.1.0.5"]
    inet6 = (
        "00000000000000000000000000000001 01 80 10 80 lo\n"
        "fe8000000000000000fc00fffe000001 04 40 20 80 eth0\n"
        "fd000000000000000000000000000002 04 40 00 82 eth0\n"
    )
    assert mp.parse_if_inet6(inet6) == ["fd00::2"]
    hosts = "127.0.0.1 localhost\n10.1.0.5 gpu1.example.org gpu1 # me\n"
    assert mp.hostnames("gpu1\n", hosts, "(none)") == ["gpu1", "gpu1.example.org"]
    assert mp.hostnames("localhost", hosts) == []
    names = mp.node_names(
        Host("gpu1"),
        2222,
        [("10.1.0.5", "ssh_config HostName")],
        ["gpu1", "gpu1.example.org"],
        ["10.1.0.5", "fd00::2", "127.0.0.1"],
    )
    assert names == [
        ("[gpu1]:2222", "hostfile"),
        ("[10.1.0.5]:2222", "ssh_config HostName"),
        ("[gpu1.example.org]:2222", "hostname"),
        ("[fd00::2]:2222", "address"),
    ]


def test_a_name_two_nodes_claim_is_a_conflict():
    a, b = Host("10.0.0.1"), Host("10.0.0.2")
    named = {a: [("10.0.0.1", "hostfile"), ("ubuntu", "hostname")], b: [("UBUNTU", "hostname")]}
    (only,) = mp.name_conflicts(named)
    assert "'ubuntu' is claimed by 10.0.0.1 (hostname) and 10.0.0.2 (hostname)" in only
    assert mp.name_conflicts({a: [("x", "hostfile"), ("x", "address")]}) == []
    c = Host("10.0.0.3")
    bridge = {
        a: [("10.0.0.1", "hostfile"), ("172.17.0.1", "address")],
        b: [("10.0.0.2", "hostfile"), ("172.17.0.1", "address")],
        c: [("10.0.0.3", "hostfile"), ("10.0.0.1", "address")],  # a's hostfile address: chosen
    }
    kept, notes = mp.drop_shared_addresses(bridge)
    assert kept[a] == [("10.0.0.1", "hostfile")]
    assert kept[b] == [("10.0.0.2", "hostfile")]
    assert notes == [
        "address 172.17.0.1 is on 2 nodes (a local bridge such as docker0?): "
        "recorded for none of them"
    ]
    (still,) = mp.name_conflicts(kept)
    assert "'10.0.0.1' is claimed by 10.0.0.1 (hostfile) and 10.0.0.3 (address)" in still


def test_refused_files_and_authorized_keys_file():
    home = mp.FileStat.of("/home/u", stat.S_IFDIR | 0o755, 1000)
    ok = [mp.FileStat.of("~/.ssh", stat.S_IFDIR | 0o700, 1000)]
    assert mp.unsafe_files("n", home, [*ok, mp.FileStat("~/.ssh/known_hosts", "missing")]) == []
    bad = mp.unsafe_files(
        "n",
        home,
        [
            mp.FileStat.of("~/.ssh", stat.S_IFDIR | 0o777, 1000),
            mp.FileStat.of("~/.ssh/authorized_keys", stat.S_IFREG | 0o600, 4321),
            mp.FileStat.of("~/.ssh/known_hosts", stat.S_IFLNK | 0o777, 1000, "/tmp/x"),
        ],
    )
    assert "n: ~/.ssh is writable by others (owner uid 1000, mode 0777)" in bad[0]
    assert "belongs to someone else (owner uid 4321" in bad[1]
    assert "symlink to /tmp/x" in bad[2]
    assert len(bad) == 3
    directives = mp.sshd_directives(
        "# c\nPort 22\nAuthorizedKeysFile=/etc/keys/%u\nMatch User x\nAuthorizedKeysFile y\n"
    )
    assert directives == [("port", "22"), ("authorizedkeysfile", "/etc/keys/%u")]
    assert mp.authorized_keys_problem("n", None, "f", "/root") is None
    assert mp.authorized_keys_problem("n", ".ssh/authorized_keys /etc/k", "f", "/root") is None
    assert mp.authorized_keys_problem("n", "%h/.ssh/authorized_keys", "f", "/root") is None
    problem = mp.authorized_keys_problem("n", "/etc/keys/%u", "/etc/ssh/sshd_config", "/root")
    assert problem
    assert "AuthorizedKeysFile /etc/keys/%u (/etc/ssh/sshd_config)" in problem


def test_plan_every_node_gets_every_key_under_every_name_and_reruns_change_nothing():
    hosts = [Host("node0"), Host("10.0.0.2", port=2222)]
    f = [
        facts(hosts[0], "0", ["node0", "10.0.0.1"]),
        facts(hosts[1], "1", ["[10.0.0.2]:2222", "[node1]:2222"], user=False),
    ]
    plans = mp.plan(f, "aaa")
    assert plans[hosts[1]].user_key == "generate"
    assert plans[hosts[0]].user_key == "kept"
    assert len(plans[hosts[1]].authorized.added) == 1  # node1's key is not made yet
    known = plans[hosts[0]].known.added
    assert known[0].startswith("node0,10.0.0.1 ")
    assert known[1].startswith("[10.0.0.2]:2222,[node1]")
    assert all(k.endswith(" meshkit mesh=aaa") for k in known)
    assert mp.conflicts(f, plans) == []
    done = [
        facts(h, s, [n for n, _ in x.names], authorized=plans[h].authorized.text,
              known=plans[h].known.text)
        for h, s, x in zip(hosts, "01", f)
    ]  # fmt: skip
    done[1].user = mp.UserKey("kept", ".ssh/id_ed25519", None)
    assert not mp.plan(done, "aaa")[hosts[0]].changes
    assert mp.placeholder_key(hosts[0]) != mp.placeholder_key(hosts[1])
    parse_public_key(line(mp.placeholder_key(hosts[0])))


def test_unmesh_plans_keep_what_another_mesh_lists():
    h = Host("n0")
    one = mp.plan([facts(h, "0", ["n0"])], "aaa")[h]
    both = mp.plan(
        [facts(h, "0", ["n0"], authorized=one.authorized.text, known=one.known.text)], "bbb"
    )[h]
    node = facts(h, "0", ["n0"], authorized=both.authorized.text, known=both.known.text)
    first = mp.plan_unmesh(node, "aaa", keep_keys=False)
    assert first.remove_key is None
    assert first.kept_key
    assert "another mesh" in first.kept_key
    assert first.authorized_removed == 1
    assert "mesh=bbb" in (first.authorized or "")
    last = mp.plan_unmesh(
        facts(h, "0", ["n0"], authorized=first.authorized or "", known=first.known or ""),
        "bbb",
        keep_keys=False,
    )
    assert last.remove_key == ".ssh/id_ed25519"
    assert last.authorized == ""
    assert last.known == ""
    assert mp.plan_unmesh(node, "bbb", keep_keys=True).remove_key is None


def test_temp_names():
    assert mp.is_meshkit_temp(".authorized_keys.meshkit-0123456789ab")
    assert mp.is_meshkit_temp(".known_hosts.meshkit-abcdefabcdef")
    assert not mp.is_meshkit_temp(".authorized_keys.meshkit-x")
    assert not mp.is_meshkit_temp("authorized_keys")
