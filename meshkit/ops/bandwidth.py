"""``doctor --bandwidth``'s measurement: every pair's throughput both ways, on every network the
pair shares, measured by the node agents in rounds of disjoint pairs; and its verdicts (a slow
pair, a slow node, a faster network than the exported one), pure functions of the results.
``ops/doctor.py`` runs it between the env round and the collective probe.
"""

from __future__ import annotations

import ipaddress
import secrets
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .. import protocol as p
from ..hostfile import Host
from ..outcome import Outcome
from .pool import NodePool, unanswered
from .verdicts import Check, verdict

# One throughput try, one way: short and bounded in bytes, so that the best of a few tries rides
# out a busy moment of a shared machine (the sandbox's 2 cores) rather than averaging it in.
BW_SECONDS = 0.2
BW_BYTES = 64 << 20
BW_REPEATS = 3
# The first pass measures each pair on every network it shares (up to 64); a pair found slow is
# measured again twice at most, later and on the exported network only: on a shared machine one
# busy second must not name a link (the better measurement counts; a slow link stays slow).
PASSES = (64, 1, 1)
BYE = -1  # pair_rounds' stand-in partner of the node left out of a round (odd counts)

# (client, server) -> its tests, the exported network's first
Results = dict[tuple[Host, Host], list[p.BandwidthResult]]
Ifnames = dict[Host, str | None]  # node -> the interface its backends use
Replies = dict[Host, p.BandwidthReply]  # node -> its networks


@dataclass(frozen=True)
class Bandwidth:
    """``doctor --bandwidth``'s matrix: bits/s from node to peer (hostfile spellings) on the
    network the job uses; the all_reduce's bus bandwidth (bits/s) when it ran."""

    rates: dict[tuple[str, str], float]
    median: float  # over the nodes of each one's median rate
    slow_nodes: list[str]  # all of whose pairs are slow
    busbw: float | None = None


@dataclass(frozen=True)
class Attachment:
    """How a node is on one network: through which interface, at which address."""

    interface: str
    address: str


@dataclass(frozen=True)
class Measurement:
    """What ``measure_pairs`` found: its checks (bandwidth, networks, infiniband), the matrix,
    and the nodes (labels) that have no torch for the collective probe or did not say."""

    checks: list[Check]
    matrix: Bandwidth
    without_torch: list[str]


def pair_rounds(count: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``count`` nodes once, in rounds of disjoint pairs (the circle method):
    count-1 rounds of count/2 pairs; for an odd count, count rounds, each with one node out."""
    ring = list(range(count))
    if count % 2:
        ring.append(BYE)
    half = len(ring) // 2
    rounds = []
    for _ in range(len(ring) - 1):
        pairs = []
        for first, second in zip(ring[:half], reversed(ring[half:])):
            if BYE not in (first, second):
                pairs.append((min(first, second), max(first, second)))
        rounds.append(pairs)
        # the circle turns: the first node stays, the others move one place
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def disjoint(pairs: Sequence[tuple[Host, Host]]) -> list[list[tuple[Host, Host]]]:
    """``pairs`` in rounds in which no node is twice (greedy: each into the first that has room)."""
    rounds: list[list[tuple[Host, Host]]] = []
    for pair in pairs:
        room = next((round_ for round_ in rounds if not set(pair) & nodes_in(round_)), None)
        if room is None:
            rounds.append([pair])
        else:
            room.append(pair)
    return rounds


def nodes_in(round_: list[tuple[Host, Host]]) -> set[Host]:
    return {host for pair in round_ for host in pair}


def preference(result: p.BandwidthResult) -> tuple[bool, float]:
    """Of two tries, the better is the one that succeeded, then the one faster its slower way."""
    return result.error is None, min(result.sent, result.received)


def rate_text(bits: float) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.0f} bit/s"


def subnets(reply: p.BandwidthReply) -> dict[str, Attachment]:
    """A node's IPv4 networks (the first interface on each): subnet -> how it is on it."""
    found: dict[str, Attachment] = {}
    for line in reply.networks:
        interface, _, cidr = line.partition(" ")
        try:
            network = str(ipaddress.IPv4Interface(cidr).network)
        except ValueError:
            continue  # not an IPv4 address
        address = cidr.split("/")[0]
        found.setdefault(network, Attachment(interface, address))
    return found


def pair_targets(
    client: p.BandwidthReply, server: p.BandwidthReply, server_if: str | None, label: str, port: int
) -> list[p.BandwidthTarget]:
    """The client's tests towards the server: one per network both are on (the server's exported
    interface's first), never to an address the client holds itself (docker0's 172.17.0.1)."""
    mine = subnets(client)
    theirs = subnets(server)
    own = {attachment.address for attachment in mine.values()}
    shared = [net for net in theirs if net in mine and theirs[net].address not in own]
    shared.sort(key=lambda net: theirs[net].interface != server_if)
    return [p.BandwidthTarget(label, theirs[net].address, port, net) for net in shared]


def bandwidth_checks(
    hosts: Sequence[Host], results: Results, ifnames: Ifnames, min_ratio: float, min_rate: float
) -> tuple[list[Check], Bandwidth]:
    """One check per pair on the exported network (``results``: (client, server) -> its tests,
    that network's first): slow below ``min_ratio`` x the cluster's median or below ``min_rate``
    (bits/s). The median is over the nodes of each node's median rate: one slow node of three is
    still held to what the others reach, and a pair that ran alone in its round (beside a slow
    one, on a CPU-bound network) does not raise it; a node all of whose pairs are slow is named."""
    rates: dict[tuple[Host, Host], float] = {}
    for (client, server), tests in results.items():
        exported = tests[0]
        if exported.error is None:
            rates[client, server] = exported.sent * 8
            rates[server, client] = exported.received * 8
    per_node: dict[Host, list[float]] = {host: [] for host in hosts}
    for (node, peer), value in rates.items():
        per_node[node].append(value)
        per_node[peer].append(value)
    node_medians = [statistics.median(values) for values in per_node.values() if values]
    median = statistics.median(node_medians) if node_medians else 0.0
    floor = max(min_ratio * median, min_rate)
    pairs = sorted(results, key=lambda pair: (hosts.index(pair[0]), hosts.index(pair[1])))
    slow = set()
    for node, peer in pairs:
        slower_way = min(rates.get((node, peer), 0), rates.get((peer, node), 0))
        if slower_way < floor:
            slow.add((node, peer))
    # of two nodes, neither is to blame for their one slow pair
    slow_nodes = []
    if len(hosts) > 2:
        for host in hosts:
            mates = {pair for pair in pairs if host in pair}
            if mates and mates <= slow:
                slow_nodes.append(host)
    link = (
        "look at this link: cable, switch ports and negotiated speed on both ends (ethtool), or "
        "other traffic on it"
    )
    checks = []
    for node, peer in pairs:
        result = results[node, peer][0]
        culprit = next((host.label for host in slow_nodes if host in (node, peer)), None)
        if result.error:
            detail = f"failed: {result.error}"
        else:
            detail = (
                f"node->peer {rate_text(rates[node, peer])}, "
                f"peer->node {rate_text(rates[peer, node])} "
                f"on {ifnames.get(node) or result.network}; median {rate_text(median)}"
            )
        if culprit is None:
            fix = link
        else:
            fix = (
                f"every pair of {culprit} is slow: look at that node's NIC (ethtool: speed, "
                "duplex, errors), cable and switch port"
            )
        ok = (node, peer) not in slow
        checks.append(verdict("bandwidth", node, ok, detail, fix, peer.label))
    matrix = {(node.label, peer.label): value for (node, peer), value in rates.items()}
    return checks, Bandwidth(matrix, median, [host.label for host in slow_nodes])


def node_network_checks(
    hosts: Sequence[Host], replies: Replies, results: Results, ifnames: Ifnames, min_ratio: float
) -> list[Check]:
    """Per node with more than one network: each one's rate (its fastest pair there, the slower
    direction), which is fastest, and whether the exported interface is it (a failure when another
    is faster by more than 1/min_ratio on every pair, measured in turn); and its InfiniBand
    devices."""
    checks = []
    for host in hosts:
        reply = replies.get(host, p.BandwidthReply([], [], [], False))
        names = {net: attachment.interface for net, attachment in subnets(reply).items()}
        exported = ifnames.get(host) or ""
        speed: dict[str, float] = {}
        faster: dict[str, bool] = {}  # network -> faster than the exported one on every pair
        for pair, tests in results.items():
            if host not in pair or len(tests) < 2:
                continue  # only a pair measured on several networks compares them
            rates = {}
            for result in tests:
                name = names.get(result.network, result.network)
                rates[name] = min(result.sent, result.received) * 8
            exported_rate = rates.get(exported, 0.0)
            for name, rate in rates.items():
                speed[name] = max(speed.get(name, 0.0), rate)
                slower_exported = exported_rate < min_ratio * rate
                faster[name] = name != exported and faster.get(name, True) and slower_exported
        if len(speed) > 1:
            checks.append(networks_check(host, speed, faster, exported))
        checks.append(infiniband_check(host, reply))
    return checks


def networks_check(
    host: Host, speed: dict[str, float], faster: dict[str, bool], exported: str
) -> Check:
    fastest = max(speed, key=lambda name: (faster[name], speed[name]))
    shown = []
    for name, rate in speed.items():
        if name == exported:
            shown.append(f"{name} (exported) {rate_text(rate)}")
        else:
            shown.append(f"{name} {rate_text(rate)}")
    best = "the exported one is fastest" if fastest == exported else f"fastest: {fastest}"
    fix = (
        f"list this node by its {fastest} address in the hostfile, or set "
        f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={fastest} (config meshkit.env)"
    )
    detail = f"{', '.join(shown)}; {best}"
    return verdict("networks", host, not faster[fastest], detail, fix)


def infiniband_check(host: Host, reply: p.BandwidthReply) -> Check:
    """The node's InfiniBand ports, and the NCCL_IB_HCA that names its active ones (a note)."""
    found = ", ".join(reply.infiniband)
    if not found:
        return verdict("infiniband", host, True, "none found")
    active = [port.split()[0] for port in reply.infiniband if port.endswith("ACTIVE")]
    hca = ",".join(active) if active else "(none active)"
    return verdict("infiniband", host, True, f"{found}; NCCL_IB_HCA={hca}")


def bandwidth_round(
    pool: NodePool, pairs: dict[Host, Host], replies: Replies, ifnames: Ifnames, networks: int = 64
) -> Results:
    """One round: each server (``pairs``' values) listens on the addresses its client tests (on
    their first ``networks`` networks in common), for peers that present this round's token;
    each client tests towards it; the listeners close when the round ends."""
    bound = BW_REPEATS * 2 * (BW_SECONDS + 5)  # one test's worst case (a drain after each try)
    token = secrets.token_hex(16)
    tests: dict[Host, list[p.BandwidthTarget]] = {}
    for client, server in pairs.items():
        server_if = ifnames[server]
        targets = pair_targets(replies[client], replies[server], server_if, server.label, 0)
        tests[client] = targets[:networks]
    asks = {}
    for client, server in pairs.items():
        if tests[client]:
            addresses = [target.host for target in tests[client]]
            asks[server] = p.ListenRequest(
                None, 0, bound * 4, bandwidth=True, addresses=addresses, token=token
            )
    listens = pool.call_all("listen", asks.get, p.ListenReply, list(asks))
    results = {}
    for client, server in pairs.items():
        why = "no network in common"
        if tests[client]:
            listened = listens.get(server, Outcome[p.ListenReply](error="unreachable"))
            if listened.value is not None:
                cannot = listened.value.error
                port = listened.value.port
            else:
                cannot = listened.error
                port = 0
            if cannot:
                tests[client] = []
                why = f"{server.label} cannot listen: {cannot}"
            else:
                tests[client] = [replace(target, port=port) for target in tests[client]]
        # the pair's result unless its client's tests replace it below
        results[client, server] = [p.BandwidthResult(server.label, "", 0.0, 0.0, why)]

    def test(host: Host) -> p.BandwidthRequest | None:
        if not tests[host]:
            return None
        return p.BandwidthRequest(tests[host], BW_SECONDS, BW_BYTES, BW_REPEATS, token)

    most_tests = max((len(targets) for targets in tests.values()), default=1)
    timeout = bound * most_tests + 30
    try:
        done = pool.call_all("bandwidth", test, p.BandwidthReply, list(pairs), timeout=timeout)
    finally:  # the round's listeners close with it, and any peer they still serve
        pool.call_all("", lambda host: p.DoneRequest(None), p.DoneReply, list(asks))
    for client, server in pairs.items():
        if client not in done:
            continue
        outcome = done[client]
        if outcome.value is not None:
            results[client, server] = outcome.value.results
        else:
            failed = p.BandwidthResult(server.label, "", 0.0, 0.0, str(outcome.error))
            results[client, server] = [failed]
    return results


def better_of(
    old: list[p.BandwidthResult], new: list[p.BandwidthResult]
) -> list[p.BandwidthResult]:
    """Network by network, the better of two measurements of a pair (a later pass measures only
    the first network: the others keep ``old``'s)."""
    better = [max(two, key=preference) for two in zip(old, new)]
    return better + old[len(new) :]


def measure_pairs(
    pool: NodePool, hosts: Sequence[Host], ifnames: Ifnames, min_ratio: float, min_rate: float
) -> Measurement:
    """Each node's networks, then every pair in rounds of disjoint pairs (``PASSES``), then the
    verdicts; the agents' listeners are closed however it ends."""
    asked = p.BandwidthRequest([], 0, 0, 0)
    found = pool.call_all("networks", lambda host: asked, p.BandwidthReply)
    replies = {}
    for host, outcome in found.items():
        if outcome.value is not None:
            replies[host] = outcome.value
    checks = []
    for host in hosts:
        if host not in replies:
            why = unanswered(found.get(host), host, pool.failures)
            checks.append(verdict("bandwidth", host, False, why, "fix the node"))
    results: Results = {}
    todo = []
    for numbered in pair_rounds(len(hosts)):
        todo.append([(hosts[first], hosts[second]) for first, second in numbered])
    try:
        for networks in PASSES:
            for round_ in todo:
                pairs = {}
                for client, server in round_:
                    if client in replies and server in replies:
                        pairs[client] = server
                measured = bandwidth_round(pool, pairs, replies, ifnames, networks)
                for pair, new in measured.items():
                    if pair in results:
                        results[pair] = better_of(results[pair], new)
                    else:
                        results[pair] = new
            pair_checks, matrix = bandwidth_checks(hosts, results, ifnames, min_ratio, min_rate)
            slow = {(check.node, check.peer) for check in pair_checks if not check.ok}
            again = [pair for pair in results if (pair[0].label, pair[1].label) in slow]
            todo = disjoint(again)
    finally:
        pool.call_all("", lambda host: p.DoneRequest(None), p.DoneReply)
    checks += pair_checks
    checks += node_network_checks(hosts, replies, results, ifnames, min_ratio)
    without_torch = [host.label for host in hosts if host not in replies or not replies[host].torch]
    return Measurement(checks, matrix, without_torch)
