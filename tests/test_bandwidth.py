"""doctor --bandwidth: the pure parts on plain data (the round-robin schedule, the verdicts), then
the real thing on a 4-node sandbox with two networks per node: all pairs ok when healthy; one link
slowed to 20 Mbit/s both ways (sandbox.shape, tc) is the only pair flagged; one node slowed on its
whole interface is flagged against every peer and nothing else is; the heatmap is written."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import combinations
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import meshkit, named, need_root, sandbox_dir

from meshkit import sandbox
from meshkit.cli.common import rate
from meshkit.discovery import read_hosts
from meshkit.errors import UsageError
from meshkit.hostfile import Host, parse
from meshkit.ops import bandwidth
from meshkit.ops.pool import NodePool
from meshkit.outcome import Outcome
from meshkit.protocol import (
    BandwidthReply,
    BandwidthResult,
    ListenReply,
    ListenRequest,
    Reply,
    Request,
)

R = TypeVar("R", bound=Reply)
HOSTS = parse("10.0.0.1\n10.0.0.2\n10.0.0.3\n10.0.0.4\n")
GBIT = 1e9 / 8  # bytes/s of 1 Gbit/s
MBIT = 1e6 / 8  # bytes/s of 1 Mbit/s


@pytest.mark.parametrize("n", range(1, 10))
def test_rounds_cover_every_pair_once_and_no_node_twice_in_a_round(n):
    rounds = bandwidth.pair_rounds(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n) or n == 1
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(combinations(range(n), 2))
    for r in rounds:
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes)) == 2 * (n // 2)


def test_retests_go_in_rounds_of_disjoint_pairs():
    a, b, c, d = HOSTS
    assert bandwidth.disjoint([(a, d), (b, d), (c, d), (a, b)]) == [
        [(a, d)],
        [(b, d)],
        [(c, d), (a, b)],
    ]


def results(slow: set[tuple[int, int]], hosts=HOSTS) -> dict:
    """Every pair at 9-11 Gbit/s (a little noise), ``slow`` ones at 20 Mbit/s both ways."""
    found = {}
    for i, j in combinations(range(len(hosts)), 2):
        if (i, j) in slow:
            up = 20 * MBIT
            down = 20 * MBIT
        else:
            up = (9 + i) * GBIT
            down = (11 - j) * GBIT
        found[hosts[i], hosts[j]] = [BandwidthResult(hosts[j].label, "n", up, down, None)]
    return found


def test_verdict_one_slow_link_is_the_only_pair_flagged():
    checks, bw = bandwidth.bandwidth_checks(HOSTS, results({(0, 2)}), {}, 0.5, 0.0)
    assert [(c.node, c.peer) for c in checks if not c.ok] == [("10.0.0.1", "10.0.0.3")]
    bad = next(c for c in checks if not c.ok)
    assert "node->peer 20 Mbit/s, peer->node 20 Mbit/s" in bad.detail
    assert "link" in bad.fix
    assert bw.slow_nodes == []
    assert bw.rates["10.0.0.3", "10.0.0.1"] == pytest.approx(20e6)
    # an absolute floor flags every pair whose slower direction is under it
    checks, _ = bandwidth.bandwidth_checks(HOSTS, results(set()), {}, 0.5, 8.5e9)
    assert [c.peer for c in checks if not c.ok] == ["10.0.0.4"] * 3  # 11-3 = 8 Gbit/s back


@pytest.mark.parametrize("count", [3, 4])
def test_a_slow_node_is_named_against_every_peer(count):
    hosts = HOSTS[:count]
    last = count - 1
    slow = {(i, last) for i in range(last)}
    checks, bw = bandwidth.bandwidth_checks(hosts, results(slow, hosts), {}, 0.5, 0.0)
    assert sorted((c.node, c.peer) for c in checks if not c.ok) == [
        (h.label, hosts[last].label) for h in hosts[:last]
    ]
    assert bw.slow_nodes == [hosts[last].label]
    assert all(f"every pair of {hosts[last].label}" in c.fix for c in checks if not c.ok)


def test_a_failed_test_is_a_failed_pair():
    found = results(set())
    found[HOSTS[1], HOSTS[3]] = [BandwidthResult("10.0.0.4", "", 0, 0, "10.0.0.4:1: refused")]
    checks, _ = bandwidth.bandwidth_checks(HOSTS, found, {}, 0.5, 0.0)
    bad = [c for c in checks if not c.ok]
    assert [(c.peer, c.detail) for c in bad] == [("10.0.0.4", "failed: 10.0.0.4:1: refused")]


def reply(*networks: str, ib: tuple[str, ...] = ()) -> BandwidthReply:
    return BandwidthReply([], list(networks), list(ib), True)


def test_targets_every_shared_network_exported_first_never_an_own_address():
    client = reply("eth0 10.1.0.1/24", "eth1 10.2.0.1/24", "docker0 172.17.0.1/16")
    server = reply("ib0 10.2.0.2/24", "eno1 10.1.0.2/24", "docker0 172.17.0.1/16", "x 10.9.0.2/24")
    targets = bandwidth.pair_targets(client, server, "eno1", "s", 40000)
    assert [(t.network, t.host) for t in targets] == [
        ("10.1.0.0/24", "10.1.0.2"),
        ("10.2.0.0/24", "10.2.0.2"),
    ]


def test_networks_name_the_fastest_and_infiniband_the_hca():
    a, b = HOSTS[:2]
    replies = {
        a: reply("eth0 10.1.0.1/24", "ib0 10.2.0.1/24", ib=("mlx5_0:1 ACTIVE", "mlx5_1:1 DOWN")),
        b: reply("eth0 10.1.0.2/24", "ib0 10.2.0.2/24"),
    }
    tests = {
        (a, b): [
            BandwidthResult(b.label, "10.1.0.0/24", 1 * GBIT, 1 * GBIT, None),
            BandwidthResult(b.label, "10.2.0.0/24", 90 * GBIT, 80 * GBIT, None),
        ]
    }
    checks = bandwidth.node_network_checks([a, b], replies, tests, {a: "eth0", b: "ib0"}, 0.5)
    got = {(c.check, c.node): c for c in checks}
    assert not got["networks", a.label].ok
    assert "fastest: ib0" in got["networks", a.label].detail
    assert "NCCL_SOCKET_IFNAME=ib0" in got["networks", a.label].fix
    assert got["networks", b.label].ok
    assert got["networks", b.label].detail.endswith("the exported one is fastest")
    assert got["infiniband", a.label].detail.endswith("NCCL_IB_HCA=mlx5_0:1")
    assert got["infiniband", b.label].detail == "none found"


def test_rates_parse_as_tc_counts_them():
    assert rate("20Mbit", "--rate") == 20e6
    assert rate("1.5G", "--x") == 1.5e9
    assert rate("100mbit/s", "--x") == 100e6
    assert rate("1e9", "--x") == 1e9
    for bad in ("fast", "0", "-1", "20MB/s", "1..2M"):
        with pytest.raises(UsageError, match="expected a rate such as 20Mbit"):
            rate(bad, "--rate")


# ---- on a sandbox: 4 nodes, two networks each ----------------------------------------------

NAME = named("nbandw")


@pytest.fixture(scope="module")
def meshed() -> Iterator[tuple[sandbox.Layout, Path]]:
    need_root()
    path = sandbox_dir(NAME)
    opts = sandbox.NetworkOptions(second=True, ifnames=True)
    lay = sandbox.up(path, sandbox.default_subnet("", NAME), 4, NAME, networks=opts)
    try:
        out = meshkit("mesh", "--hostfile", str(lay.hostfile), "--no-verify")
        assert out.returncode == 0, out.stdout + out.stderr
        workdir = lay.shared / "work"
        workdir.mkdir()
        yield lay, workdir
    finally:
        sandbox.down(path, NAME)


def run_bandwidth(lay: sandbox.Layout, workdir: Path, *extra: str) -> tuple[int, dict, float]:
    """``meshkit doctor --bandwidth --json`` from inside node1, as a user logged in there."""
    argv = [sys.executable, "-m", "meshkit", "doctor", "--hostfile", str(lay.hostfile)]
    # The sandbox's links are veths whose rate is whatever CPU is left: beside CI's other workers
    # a healthy pair measured at 0.46x the median (CI, on record), under the default 0.5. The
    # shaped links below are 20 Mbit/s against several Gbit/s, far under a fifth of it.
    argv += ["--bandwidth", "--json", "--min-ratio", "0.2", *extra]
    line = f"cd {shlex.quote(str(workdir))} && {shlex.join(argv)}"
    started = time.monotonic()
    out = sandbox.node_exec(lay.nodes[1], ["bash", "-c", line], timeout=300)
    took = time.monotonic() - started
    assert "Traceback" not in out.stderr, out.stderr
    print(f"doctor --bandwidth on {lay.count} nodes: {took:.1f}s")
    return out.returncode, json.loads(out.stdout), took


def failed(report: dict) -> list[tuple[str, str, str | None]]:
    return [(c["check"], c["node"], c["peer"]) for c in report["checks"] if not c["ok"]]


def why(report: dict) -> str:
    return "\n".join(
        f"{c['check']} {c['node']} {c['peer']}: {c['detail']}" for c in report["checks"]
    )


BOTH_WAYS = re.compile(r"node->peer [0-9.]+ [MG]bit/s, peer->node [0-9.]+ [MG]bit/s on \S+; ")


def test_a_healthy_cluster_has_every_pair_ok_and_a_heatmap(meshed):
    lay, workdir = meshed
    png = workdir / "healthy.png"
    code, report, _ = run_bandwidth(lay, workdir, "--plot", str(png))
    assert (code, failed(report)) == (0, []), why(report)
    labels = [n.address for n in lay.nodes]
    pairs = [(c["node"], c["peer"]) for c in report["checks"] if c["check"] == "bandwidth"]
    assert pairs == list(combinations(labels, 2))
    for c in report["checks"]:
        assert set(c) == {"check", "node", "peer", "ok", "detail", "fix"}
        if c["check"] == "bandwidth":
            # each way's rate in the unit that reads best: Gbit/s as a rule, Mbit/s for a pair
            # that CI's other sandboxes slowed on the shared cores (802 Mbit/s seen)
            assert BOTH_WAYS.match(c["detail"]), c["detail"]
    nets = {c["node"]: c["detail"] for c in report["checks"] if c["check"] == "networks"}
    assert sorted(nets) == labels  # the second network measured too, on every node
    assert "eth0 (exported)" in nets[labels[0]]
    assert "eth1 " in nets[labels[0]]
    ib = {c["detail"] for c in report["checks"] if c["check"] == "infiniband"}
    assert ib == {"none found"}
    probes = [c["detail"] for c in report["checks"] if c["check"] == "collective"]
    assert len(probes) == 4
    assert all(" busbw=" in p for p in probes)
    assert all(p.endswith("ok=True") for p in probes)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_slow_link_is_the_only_pair_flagged(meshed):
    lay, workdir = meshed
    sandbox.shape(lay, 0, 2, 20_000_000)
    try:
        code, report, _ = run_bandwidth(lay, workdir)
    finally:
        sandbox.unshape(lay)
    a = lay.nodes[0].address
    b = lay.nodes[2].address
    assert (code, failed(report)) == (1, [("bandwidth", a, b)]), why(report)
    bad = next(c for c in report["checks"] if not c["ok"])
    assert "Mbit/s" in bad["detail"]
    assert "link" in bad["fix"]


def test_one_slow_node_is_flagged_against_its_peers_and_nothing_else(meshed):
    lay, workdir = meshed
    page = workdir / "node.html"
    sandbox.shape(lay, 3, None, 20_000_000)
    try:
        code, report, _ = run_bandwidth(lay, workdir, "--plot", str(page))
    finally:
        sandbox.unshape(lay)
    slow = lay.nodes[3].address
    pairs = [("bandwidth", n.address, slow) for n in lay.nodes[:3]]
    # its second network is still fast: that it is, and not the exported one, is said too
    assert (code, failed(report)) == (1, [*pairs, ("networks", slow, None)]), why(report)
    fixes = [c["fix"] for c in report["checks"] if not c["ok"] and c["check"] == "bandwidth"]
    assert all(f"every pair of {slow}" in f for f in fixes)
    assert "<table>" in page.read_text()


def test_bad_flags_are_usage_errors(meshed):
    lay, _ = meshed
    host = ["--hostfile", str(lay.hostfile)]
    for argv, said in (
        (["doctor", *host, "--min-rate", "1G"], "go with --bandwidth"),
        (["doctor", *host, "--bandwidth", "--plot", "x.svg"], "expected a .png or .html"),
        (["doctor", *host, "--bandwidth", "--min-ratio", "2"], "between 0 and 1"),
        (["sandbox.shape", "--name", NAME, "--node", "0", "--rate", "fast"], "20Mbit"),
    ):
        out = meshkit(*argv)
        assert out.returncode == 2
        assert said in out.stderr
        assert "Traceback" not in out.stderr


class Intruded:
    """A ``NodePool`` that, as each bandwidth listener opens, reads which addresses listen on its
    port on that node (/proc/net/tcp) and points a tokenless peer and a slow peer (a byte every
    half second) at it, before the round's clients test."""

    def __init__(self, pool: NodePool, lay: sandbox.Layout) -> None:
        self.pool = pool
        self.nodes = {node.address: node for node in lay.nodes}
        self.bound: dict[str, tuple[list[str], list[str]]] = {}  # node -> (asked, listening)
        self.ports: dict[str, list[int]] = {}  # node -> the ports it listened on
        self.answers: list[bytes] = []  # what the tokenless peers got
        self.peers: list[threading.Thread] = []

    @property
    def failures(self) -> dict[Host, str]:
        return self.pool.failures

    def write_file(
        self, host: Host, path: str, text: str, mode: int = 0o644, root: str = ""
    ) -> None:
        self.pool.write_file(host, path, text, mode, root)

    def call_all(
        self,
        phase: str,
        request_for: Callable[[Host], Request | None],
        expect: type[R],
        hosts: Sequence[Host] | None = None,
        timeout: float | None = None,
    ) -> dict[Host, Outcome[R]]:
        found = self.pool.call_all(phase, request_for, expect, hosts, timeout)
        if phase != "listen":
            return found
        for host, outcome in found.items():
            reply = outcome.value
            assert isinstance(reply, ListenReply) and reply.error is None, outcome
            asked = request_for(host)
            assert isinstance(asked, ListenRequest)
            table = sandbox.node_exec(self.nodes[host.label], ["cat", "/proc/net/tcp"]).stdout
            self.bound[host.label] = (asked.addresses, listening(table, reply.port))
            self.ports.setdefault(host.label, []).append(reply.port)
            address = (reply.address, reply.port)
            for peer in (self.tokenless, self.slow):
                thread = threading.Thread(target=peer, args=(address,), daemon=True)
                thread.start()
                self.peers.append(thread)
        time.sleep(0.3)  # the intruders connect first
        return found

    def tokenless(self, address: tuple[str, int]) -> None:
        """The old protocol's header, then data: nothing may be served to it."""
        with socket.create_connection(address, timeout=10) as peer:
            try:
                peer.sendall(b"send 0.2 1000000".ljust(32))
                self.answers.append(peer.recv(1024))
            except ConnectionResetError:
                self.answers.append(b"")

    def slow(self, address: tuple[str, int]) -> None:
        """A byte every half second, 40 at most, until the listener closes it."""
        with socket.create_connection(address, timeout=10) as peer, contextlib.suppress(OSError):
            for _ in range(40):
                peer.sendall(b"s")
                time.sleep(0.5)


def listening(table: str, port: int) -> list[str]:
    """The local addresses listening on ``port`` in a /proc/net/tcp table."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        local_hex, port_hex = fields[1].split(":")
        if fields[3] == "0A" and int(port_hex, 16) == port:
            found.append(socket.inet_ntoa(struct.pack("<I", int(local_hex, 16))))
    return sorted(found)


def test_the_listener_binds_the_tested_addresses_and_serves_no_intruder(meshed):
    """A round of ``measure_pairs`` with a tokenless and a slow peer at every listener: they get
    nothing, every pair is still measured ok, and each listener listens on exactly the addresses
    its client tests (the exported network's first), never on every address, until its round
    ends."""
    from meshkit.remote import AgentPool, Settings

    lay, _ = meshed
    hosts = read_hosts(lay.hostfile)
    settings = Settings(connect_timeout=5.0, ssh_configs=(str(lay.ssh_config),))
    with AgentPool.connect(hosts, settings, sys.executable) as agents:
        pool = Intruded(agents, lay)
        ifnames: dict[Host, str | None] = {host: "eth0" for host in hosts}
        measured = bandwidth.measure_pairs(pool, hosts, ifnames, 0.1, 0.0)
    for peer in pool.peers:
        peer.join(timeout=30)
    pairs = [c for c in measured.checks if c.check == "bandwidth"]
    assert len(pairs) == 6
    assert all(c.ok for c in pairs), [c.detail for c in pairs if not c.ok]
    assert pool.answers and set(pool.answers) == {b""}
    assert len(pool.bound) >= 3
    for node, (asked, bound) in pool.bound.items():
        assert asked[0] == node  # the exported network's address first
        assert bound == sorted(asked), node
        assert "0.0.0.0" not in bound
    for node, ports in pool.ports.items():  # every round's listeners closed with it
        table = sandbox.node_exec(pool.nodes[node], ["cat", "/proc/net/tcp"]).stdout
        assert [port for port in ports if listening(table, port)] == [], node
