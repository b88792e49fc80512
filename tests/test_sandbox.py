"""The sandbox is a realistic cluster: separate machines on a network, sharing storage."""

from __future__ import annotations

import importlib
import ipaddress
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshkit, named, need_root, sandbox_dir, sandbox_name, ssh

from meshkit import sandbox
from meshkit.sandbox import networks

SANDBOX_NODES = 4


def test_every_node_is_reachable_from_the_controller_with_the_bootstrap_key(cluster):
    for node in cluster.nodes:
        out = ssh(cluster, node.name, "hostname")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == node.name


def negotiated_kex(lay, node: str) -> str:
    """The key exchange OpenSSH's client agrees with ``node``'s sshd (from ``ssh -v``)."""
    out = subprocess.run(
        ["ssh", "-v", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", node, "true"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr.split("kex: algorithm: ", 1)[1].split()[0]


def test_the_nodes_sshd_offers_curve25519_only_by_default(cluster):
    """OpenSSH 9.2's sntrup761x25519 costs each client about 80 ms of CPU per connection; the
    sandbox's nodes share this machine's cores, so their sshd offers curve25519 (layout.KEXES)."""
    assert sandbox.load(cluster.root).kex == "fast"
    assert negotiated_kex(cluster, "node2") == "curve25519-sha256"


def test_nodes_do_not_trust_each_other_before_mesh(cluster):
    out = ssh(
        cluster,
        "node1",
        f"ssh -o BatchMode=yes -o ConnectTimeout=5 {cluster.nodes[2].address} true",
    )
    assert out.returncode != 0
    assert "Host key verification failed" in out.stderr or "Permission denied" in out.stderr


def test_each_node_has_its_own_identity_and_shares_storage(cluster):
    marker = cluster.shared / "visible-everywhere"
    marker.write_text("shared\n")
    probe = (
        "echo name=$(hostname); echo addr=$(hostname -I); echo ssh=$(ls -A ~/.ssh); "
        "hostname > /tmp/mine; "
        f"echo tmp=$(ls -A /tmp | grep -c mine); echo shared=$(cat {marker}); "
        "echo hostkey=$(cut -d' ' -f2 /etc/ssh/ssh_host_ed25519_key.pub); "
        "echo init=$(tr '\\0' ' ' < /proc/1/cmdline | cut -c1-14); "
        "echo others=$(pgrep -c -f '[s]shd_config -E')"
    )
    seen = []
    for node in cluster.nodes:
        out = ssh(cluster, node.name, probe)
        assert out.returncode == 0, out.stderr
        seen.append(dict(line.split("=", 1) for line in out.stdout.splitlines()))
    assert [s["name"] for s in seen] == [n.name for n in cluster.nodes]
    assert [s["addr"].strip() for s in seen] == [n.address for n in cluster.nodes]
    assert all(
        s["ssh"] == "authorized_keys" and s["tmp"] == "1" and s["shared"] == "shared" for s in seen
    )
    assert len({s["hostkey"] for s in seen}) == len(cluster.nodes)  # own host keys
    # own process table: its sshd is PID 1 and the other nodes' sshds are invisible
    assert all(s["init"] == "sshd: /usr/sbi" and s["others"] == "1" for s in seen), seen
    # /tmp is each node's own: each /tmp/mine landed in that node's private directory
    assert [(cluster.node_dir(n) / "tmp" / "mine").read_text().strip() for n in cluster.nodes] == [
        n.name for n in cluster.nodes
    ]


def test_controller_secrets_are_hidden_from_nodes(cluster):
    out = ssh(cluster, "node0", f"ls -A {cluster.root}/controller {cluster.root}/nodes")
    assert out.returncode == 0
    assert "id_ed25519" not in out.stdout
    assert "node1" not in out.stdout


def test_env_json_gives_each_node_its_rank_and_the_same_master(cluster):
    results = []
    for node in cluster.nodes:
        out = sandbox.node_exec(
            node,
            [sys.executable, "-m", "meshkit", "env", "--json", "--hostfile", str(cluster.hostfile)],
        )
        assert out.returncode == 0, out.stderr
        results.append(json.loads(out.stdout))
    assert [r["NODE_RANK"] for r in results] == [str(i) for i in range(len(cluster.nodes))]
    assert {(r["NNODES"], r["MASTER_ADDR"], r["MASTER_PORT"]) for r in results} == {
        (str(len(cluster.nodes)), cluster.nodes[0].address, results[0]["MASTER_PORT"])
    }
    assert [r["matched"] for r in results] == [f"{n.address} on eth0" for n in cluster.nodes]
    assert all(r["source"] == "hostfile" for r in results)


def test_env_outside_the_cluster_is_a_clear_error(cluster):
    out = meshkit("env", "--hostfile", str(cluster.hostfile))
    assert out.returncode != 0
    assert "matches no line" in out.stderr
    assert "local addresses:" in out.stderr
    assert "Traceback" not in out.stderr


def test_reboot_kills_tmux_and_empties_tmp(cluster):
    assert (
        ssh(
            cluster, "node3", "tmux new-session -d -s victim sleep 600 && touch /tmp/before"
        ).returncode
        == 0
    )
    assert ssh(cluster, "node3", "tmux has-session -t victim").returncode == 0
    out = meshkit(
        "sandbox.reboot", "--node", "3", "--dir", str(cluster.root), "--name", cluster.name
    )
    assert out.returncode == 0, out.stderr
    after = ssh(cluster, "node3", "tmux has-session -t victim; echo rc=$?; ls -A /tmp")
    assert "rc=1" in after.stdout
    assert "before" not in after.stdout
    assert ssh(cluster, "node2", "hostname").stdout.strip() == "node2"  # the others are untouched


def test_status_and_bad_input(cluster):
    out = meshkit("sandbox.status", "--dir", str(cluster.root), "--name", cluster.name, "--json")
    assert [s["sshd"] for s in json.loads(out.stdout)] == [True] * len(cluster.nodes)
    out = meshkit(
        "sandbox.reboot", "--node", "99", "--dir", str(cluster.root), "--name", cluster.name
    )
    assert out.returncode != 0
    assert "nodes 0..3" in out.stderr


def test_down_leaves_nothing_and_up_is_idempotent(cluster):
    # re-up over a live sandbox replaces it
    where = ["--dir", str(cluster.root), "--name", cluster.name]
    up = meshkit("sandbox.up", "--nodes", "2", *where, "--subnet", str(cluster.subnet))
    assert up.returncode == 0, up.stderr
    out = meshkit("sandbox.down", *where)
    assert out.returncode == 0, out.stderr
    assert (
        f"meshkit-{cluster.name}-n"
        not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
    assert (
        subprocess.run(["ip", "link", "show", cluster.bridge], capture_output=True).returncode != 0
    )
    mine = (
        f"-E {cluster.root}/logs/"  # this sandbox's sshds; other modules' sandboxes run beside it
    )
    procs = subprocess.run(["pgrep", "-f", mine], capture_output=True, text=True).stdout
    assert procs.strip() == ""
    assert not cluster.root.exists()
    assert (
        meshkit("sandbox.down", "--dir", str(cluster.root), "--name", cluster.name).stdout.strip()
        == "no sandbox to remove"
    )


def test_neighbour_table_is_only_ever_raised(tmp_path):
    """About N² ARP entries machine-wide: past gc_thresh3 the kernel drops new neighbours and
    node pairs time out (seen at N=32 in the benchmarks' doctor)."""
    from meshkit.sandbox import neighbour_room

    for family in ("ipv4", "ipv6"):
        d = tmp_path / family / "neigh" / "default"
        d.mkdir(parents=True)
        (d / "gc_thresh3").write_text("1024\n")
        (d / "gc_thresh2").write_text("999999\n")
    changed = neighbour_room(64, tmp_path)
    assert changed == [
        "net.ipv4.neigh.default.gc_thresh3=9736",
        "net.ipv6.neigh.default.gc_thresh3=9736",
    ]
    assert (tmp_path / "ipv4" / "neigh" / "default" / "gc_thresh2").read_text() == "999999\n"
    assert neighbour_room(8, tmp_path) == []  # already room


def test_a_24_holds_244_nodes_and_every_interface_name_fits():
    """Node i is subnet + 11 + i up to .254 (.255 is the broadcast); Linux interface names are at
    most 15 characters, and the longest is a veth of the longest sandbox name at the last node."""
    from meshkit.errors import SandboxError

    layout_module = importlib.import_module(
        "meshkit.sandbox.layout"
    )  # `sandbox.layout` is a function

    assert layout_module.MAX_NODES == 244
    assert layout_module.max_nodes(ipaddress.IPv4Network("10.77.3.0/24")) == 244
    assert layout_module.max_nodes(ipaddress.IPv4Network("10.77.3.0/25")) == 116  # .11 .. .126
    longest = "a" * layout_module.NAME_MAX
    for name in (longest, "default", "b"):
        lay = layout_module.layout(
            "/nonexistent", "10.77.3.0/24", 244, name, networks.NetworkOptions.all()
        )
        assert lay.nodes[-1].address == "10.77.3.254"
        assert max(len(ifname) for ifname in layout_module.ifnames(lay)) <= layout_module.IFNAME_MAX
    lay = layout_module.layout(
        "/nonexistent", "10.77.3.0/24", 244, longest, networks.NetworkOptions.all()
    )
    assert lay.nodes[-1].veth == "mkaaaaaaaa-243"
    assert len(lay.nodes[-1].veth) == 14
    assert lay.nodes[-1].netns == "meshkit-aaaaaaaa-n243"
    for count, subnet, why in (
        (245, "10.77.3.0/24", "expected 1..244"),
        (0, "10.77.3.0/24", "expected 1..244"),
        (117, "10.77.3.0/25", "holds 116"),
    ):
        with pytest.raises(SandboxError, match=why):
            layout_module.layout("/nonexistent", subnet, count, "b")
    with pytest.raises(SandboxError, match="use 1-8"):
        layout_module.layout("/nonexistent", "10.77.3.0/24", 2, "a" * (layout_module.NAME_MAX + 1))
    with pytest.raises(SandboxError, match="--bashrc"):
        layout_module.layout("/nonexistent", "10.77.3.0/24", 2, "b", bashrc="fish")
    with pytest.raises(SandboxError, match="kex 'none': expected one of fast, openssh"):
        layout_module.layout("/nonexistent", "10.77.3.0/24", 2, "b", kex="none")


def test_the_conda_bashrc_costs_a_hook_and_counts_every_shell():
    """The realistic node shell: every shell sshd starts (an exec channel, the SFTP server) runs
    the hook and is counted with the command it ran; the bashrc is in state.json, so load and
    the counters see it. With the benchmarks' ``kex="openssh"`` the nodes' sshd keeps OpenSSH's
    own key exchanges."""
    need_root()
    name = named("conda")
    subnet = sandbox.default_subnet("", name)
    lay = sandbox.up(sandbox_dir(name), subnet, 2, name, bashrc="conda", kex="openssh")
    try:
        assert sandbox.load(lay.root).bashrc == "conda"
        assert sandbox.load(lay.root).kex == "openssh"
        config = (lay.node_dir(lay.nodes[0]) / "etc_ssh" / "sshd_config").read_text()
        assert "KexAlgorithms" not in config
        sandbox.reset_shells(lay)
        out = ssh(lay, "node1", "echo shlvl=$CONDA_SHLVL")
        assert out.returncode == 0, out.stderr
        assert "shlvl=1" in out.stdout, out.stderr
        sftp = subprocess.run(
            ["sftp", "-F", str(lay.ssh_config), "-b", "-", "node0"],
            input="ls /tmp\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert sftp.returncode == 0, sftp.stderr
        assert sandbox.shells(lay) == [
            ["/usr/lib/openssh/sftp-server"],
            ["echo shlvl=$CONDA_SHLVL"],
        ]
        sandbox.reset_shells(lay)
        assert sandbox.shells(lay) == [[], []]
    finally:
        sandbox.down(sandbox_dir(name), name)


def test_an_automatic_subnet_is_the_first_choice_that_nothing_here_overlaps():
    from meshkit.errors import SandboxError
    from meshkit.sandbox.host_setup import free_subnet
    from meshkit.sandbox.layout import AUTO_CHOICES, auto_choices

    def net(text: str) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(text)

    choices = auto_choices("b")
    assert len(choices) == len(set(choices)) == AUTO_CHOICES
    assert all(choice.subnet_of(net("10.77.0.0/16")) for choice in choices)
    assert net("10.77.0.0/24") not in choices  # the default sandbox's
    assert auto_choices("b") == choices  # the same order every time
    assert free_subnet(choices, [], second=False) == choices[0]
    # a route over the first choice, an address inside the second: the third
    used = [choices[0], net(f"{choices[1].network_address + 7}/32"), net("192.168.0.0/16")]
    assert free_subnet(choices, used, second=False) == choices[2]
    # with a second network (subnet + 0.1.0.0), that one must be free too
    second_of_third = net(f"10.78.{choices[2].network_address.packed[2]}.0/24")
    assert free_subnet(choices, [*used, second_of_third], second=True) == choices[3]
    assert free_subnet(choices, [*used, second_of_third], second=False) == choices[2]
    # the choices wrap around past 10.77.250.0/24
    last = [net(f"10.77.{third}.0/24") for third in range(1, AUTO_CHOICES + 1)]
    assert free_subnet(last[-2:] + last[:-2], last[-2:], second=False) == last[0]
    with pytest.raises(SandboxError, match="no free sandbox subnet"):
        free_subnet(choices, [net("10.77.0.0/16")], second=False)


def test_two_sandboxes_whose_names_pick_the_same_subnet_both_come_up():
    """Two sandboxes (two checkouts' tests, say) whose names hash to the same first subnet: the
    second takes the next free one rather than being refused."""
    need_root()
    from meshkit.sandbox.layout import auto_choices

    first_of: dict[ipaddress.IPv4Network, str] = {}
    pair: list[str] = []
    for i in range(1000):
        name = named(f"s{i}")
        choice = auto_choices(name)[0]
        if choice in first_of:
            pair = [first_of[choice], name]
            break
        first_of[choice] = name
    ups = []
    try:
        for name in pair:
            ups.append(sandbox.up(sandbox_dir(name), sandbox.default_subnet("", name), 1, name))
        assert ups[0].subnet != ups[1].subnet
        assert all(lay.subnet in auto_choices(lay.name) for lay in ups)
        for lay in ups:
            out = ssh(lay, "node0", "hostname")
            assert out.returncode == 0, out.stderr
            assert sandbox.load(lay.root).subnet == lay.subnet
    finally:
        for name in pair:
            sandbox.down(sandbox_dir(name), name)


def test_every_test_module_has_a_sandbox_name_of_its_own() -> None:
    """Modules that run in parallel must not share a sandbox: one would take the other's down."""
    modules = sorted(path.stem for path in Path(__file__).parent.glob("test_*.py"))
    names = [sandbox_name(module) for module in modules]
    shared = {name for name in names if names.count(name) > 1}
    assert not shared, [module for module in modules if sandbox_name(module) in shared]
    assert all(len(name) <= 8 for name in names)
