"""``meshkit doctor``: prove, per node and per pair, that the cluster can train before it does.

Every check goes through the node agents (``NodePool``) and is bounded in time; the N x N SSH
check is the mesh's own verify, passed in by the caller. Functions return a ``Report`` and print
nothing; the verdicts are pure functions of the replies (unit-tested with plain data).
"""

from __future__ import annotations

import contextlib
import ipaddress
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..hostfile import Host
from ..job import Job
from ..meshplan import PairFailure
from ..protocol import (
    BandwidthReply,
    BandwidthRequest,
    BandwidthResult,
    BandwidthTarget,
    ConnectReply,
    ConnectRequest,
    ConnectResult,
    DoneReply,
    DoneRequest,
    EnvReply,
    FactsReply,
    ListenReply,
    ListenRequest,
    ProbeReply,
    ProbeRequest,
    ProbeTarget,
)
from ..remote.group import Outcome
from .jobs import Envs, env_error, env_round
from .pool import NodePool, unanswered
from .sync import Facts, facts_round

# the order of the table: what a training job hits first comes first (a stable sort keeps nodes
# in rank order within each check)
ORDER = (
    "ssh",
    "rank",
    "interface",
    "facts",
    "versions",
    "gpus",
    "workdir",
    "clock",
    "master port",
    "reach",
    "bandwidth",
    "networks",
    "infiniband",
    "collective",
)
LISTEN_SECONDS = 30.0  # a listener's life: long enough for every node's connect round
CONNECT_SECONDS = 5.0  # each node retries its connects this long
CLOCK_SKEW = 2.0  # seconds of clock difference tolerated (on top of the round trip)
PROBE_SECONDS = 30.0  # the collective probe's init + all_reduce timeout
# One throughput try, one way: short and bounded in bytes, so that the best of a few tries rides
# out a busy moment of a shared machine (the sandbox's 2 cores) rather than averaging it in.
BW_SECONDS, BW_BYTES, BW_REPEATS = 0.2, 64 << 20, 3


@dataclass(frozen=True)
class Check:
    check: str
    node: str
    peer: str | None
    ok: bool
    detail: str
    fix: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "check": self.check,
            "node": self.node,
            "peer": self.peer,
            "ok": self.ok,
            "detail": self.detail,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Bandwidth:
    """``doctor --bandwidth``'s matrix: bits/s from node to peer (hostfile spellings) on the
    network the job uses; the all_reduce's bus bandwidth (bits/s) when it ran."""

    rates: dict[tuple[str, str], float]
    median: float  # over the nodes of each one's median rate
    slow_nodes: list[str]  # all of whose pairs are slow
    busbw: float | None = None


@dataclass(frozen=True)
class Report:
    nodes: list[str]
    checks: list[Check] = field(default_factory=list)
    bandwidth: Bandwidth | None = None  # not in the JSON: its checks carry the same rates

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "nodes": self.nodes,
            "checks": [c.as_json() for c in self.checks],
        }


Verify = Callable[[], Sequence[PairFailure]]


# ---- pure verdicts ------------------------------------------------------------------------


def ssh_checks(hosts: Sequence[Host], failures: Sequence[PairFailure]) -> list[Check]:
    """One row per node that logs in everywhere; one row per broken pair."""
    checks = []
    for source in hosts:
        broken: dict[Host, list[str]] = {}
        for f in failures:
            if f.source == source:
                broken.setdefault(f.target, []).append(f.error)
        if not broken:
            checks.append(
                Check("ssh", source.label, None, True, f"logs in to all {len(hosts)} nodes")
            )
        for target, errors in broken.items():
            # verify logs in by the hostfile spelling and checks the host key by hostname: one row a pair
            detail = "; ".join(dict.fromkeys(errors))[:300]
            checks.append(Check("ssh", source.label, target.label, False, detail, ssh_fix(detail)))
    return checks


NETWORK_ERRORS = ("No route to host", "timed out", "Connection refused", "Network is unreachable")


def ssh_fix(error: str) -> str:
    if any(e in error for e in NETWORK_ERRORS):
        return "the network between these two nodes is down (route, firewall, sshd not running)"
    return "run `meshkit mesh` (keys, known_hosts), then `meshkit check`"


@dataclass(frozen=True)
class NodeView:
    """What ``meshkit env --json`` said on one node."""

    rank: int | None
    master_addr: str | None
    ifname: str | None
    interface_source: str
    error: str | None


def read_env(outcome: Outcome[EnvReply] | None, failure: str | None) -> NodeView:
    """One node's env reply as the checks read it."""
    error = env_error(outcome, failure)
    if error is not None or outcome is None or outcome.value is None:
        return NodeView(None, None, None, "", error)
    found = outcome.value.variables
    rank = found.get("NODE_RANK", "")
    return NodeView(
        int(rank) if rank.isascii() and rank.isdigit() else None,
        found.get("MASTER_ADDR"),
        found.get("GLOO_SOCKET_IFNAME") or None,
        outcome.value.interface_source,
        None,
    )


def env_checks(hosts: Sequence[Host], views: dict[Host, NodeView]) -> list[Check]:
    checks = []
    for rank, host in enumerate(hosts):
        view = views[host]
        if view.error is not None:
            checks.append(
                Check(
                    "rank",
                    host.label,
                    None,
                    False,
                    view.error,
                    "fix the node (see detail) and rerun",
                )
            )
            continue
        checks.append(
            Check(
                "rank",
                host.label,
                None,
                view.rank == rank,
                f"NODE_RANK={view.rank} (hostfile line {host.lineno} is rank {rank})",
                ""
                if view.rank == rank
                else "list this node in the hostfile as it sees itself "
                "(an address of one of its interfaces)",
            )
        )
        if view.ifname is None and len(hosts) > 1:
            checks.append(
                Check(
                    "interface",
                    host.label,
                    None,
                    False,
                    view.interface_source or "no interface found",
                    "list addresses (not names) in the hostfile, or set GLOO_SOCKET_IFNAME and "
                    "NCCL_SOCKET_IFNAME (config meshkit.env)",
                )
            )
        else:
            checks.append(
                Check(
                    "interface", host.label, None, True, f"{view.ifname} ({view.interface_source})"
                )
            )
    return checks


def fact_checks(
    hosts: Sequence[Host],
    round_: Facts,
    failures: dict[Host, str],
    slots: int | None,
    synced: bool = False,
) -> list[Check]:
    """Versions equal to the master's; GPUs against slots; the workdir shared and writable (a
    synced job's nodes hold copies: the master's marker is not expected there); clocks within
    CLOCK_SKEW of the controller's (``timing``: when each request left and its reply came back,
    controller time)."""
    checks: list[Check] = []
    facts, timing = round_.replies, round_.timing
    master = facts.get(hosts[0])
    reference = master.value if master is not None else None
    for host in hosts:
        outcome = facts.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, failures)
            checks.append(
                Check("facts", host.label, None, False, str(why), "fix the node and rerun")
            )
            continue
        f = outcome.value
        mine = versions(f)
        if reference is None or host == hosts[0]:
            checks.append(Check("versions", host.label, None, True, describe_versions(mine)))
        else:
            theirs = versions(reference)
            differ = [f"{k} {mine[k]} (master: {theirs[k]})" for k in mine if mine[k] != theirs[k]]
            checks.append(
                Check(
                    "versions",
                    host.label,
                    None,
                    not differ,
                    "; ".join(differ) if differ else describe_versions(mine),
                    "install the same versions on every node (same venv path)" if differ else "",
                )
            )
        over = f.gpus > 0 and slots is not None and slots > f.gpus
        checks.append(
            Check(
                "gpus",
                host.label,
                None,
                not over,
                f"{f.gpus} GPUs" + (f", slots={slots}" if slots is not None else ""),
                f"set slots={f.gpus} (or fewer) in the hostfile" if over else "",
            )
        )
        copy = synced and f.marker.endswith((" is not there", " holds another run's token"))
        problems = [p for p in (f.writable,) if p] + (
            [] if f.marker in ("written", "seen") or copy else [f"marker: {f.marker}"]
        )
        checks.append(
            Check(
                "workdir",
                host.label,
                None,
                not problems,
                "; ".join(problems)
                or (
                    "shared and writable"
                    if f.marker == "seen"
                    else "writable (a synced copy)"
                    if copy
                    else "writable"
                ),
                "put the workdir on storage every node mounts at the same path (or use train --sync)"
                if problems
                else "",
            )
        )
        sent, back = timing.get(host, (f.clock, f.clock))
        skew = f.clock - (sent + back) / 2
        late = abs(skew) > CLOCK_SKEW + (back - sent) / 2
        checks.append(
            Check(
                "clock",
                host.label,
                None,
                not late,
                f"{skew:+.2f}s from the controller",
                "synchronise clocks (chrony/NTP)" if late else "",
            )
        )
    return checks


def versions(f: FactsReply) -> dict[str, str]:
    return {
        "python": f.python,
        "torch": f.torch or "-",
        "meshkit": f.meshkit,
        "CUDA": f.cuda or "-",
        "NCCL": f.nccl or "-",
    }


def describe_versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {val}" for k, val in v.items() if val != "-")


def port_check(
    master: Host, port: int, outcome: Outcome[ListenReply] | None, may_move: bool = False
) -> Check:
    """``may_move``: the caller (train) moves to a free port itself, so busy is only a note."""
    if outcome is None or outcome.value is None:
        why = outcome.error if outcome else "unreachable"
        return Check(
            "master port", master.label, None, False, f"cannot probe: {why}", "fix the node"
        )
    reply = outcome.value
    if reply.error and may_move and "busy" in reply.error:
        return Check(
            "master port",
            master.label,
            None,
            True,
            f"{reply.error} on the master {master.label}; train moves to a free port",
        )
    if reply.error:
        return Check(
            "master port",
            master.label,
            None,
            False,
            f"{reply.error} on the master {master.label}",
            f"stop what holds port {port} there, or pass --master-port (any free port)",
        )
    return Check("master port", master.label, None, True, f"port {port} free on the master")


def reach_checks(
    hosts: Sequence[Host],
    port: int,
    replies: dict[Host, Outcome[ConnectReply]],
    failures: dict[Host, str],
    what: str,
) -> list[Check]:
    """``what`` = "master port" (each node -> the master's port) or "reach" (each -> each)."""
    checks = []
    for host in hosts:
        outcome = replies.get(host)
        if outcome is None:
            continue
        if outcome.value is None:
            checks.append(Check(what, host.label, None, False, str(outcome.error), "fix the node"))
            continue
        results = outcome.value.results
        broken = [r for r in results if not r.ok]
        if not broken:
            detail = (
                f"connects to port {port} on the master"
                if what == "master port"
                else f"reaches all {len(results)} peers on their interfaces"
            )
            checks.append(Check(what, host.label, None, True, detail))
        for r in broken:
            fix = (
                f"open TCP port {port} on the master to the other nodes (firewall), or pass "
                "--master-port"
                if what == "master port"
                else "check the link and firewalls between these two nodes on this interface; "
                "gloo/NCCL connect every pair"
            )
            checks.append(Check(what, host.label, r.label, False, r.detail, fix))
    return checks


def collective_checks(
    hosts: Sequence[Host], replies: dict[Host, Outcome[ProbeReply]], failures: dict[Host, str]
) -> list[Check]:
    checks = []
    for host in hosts:
        outcome = replies.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, failures)
            checks.append(Check("collective", host.label, None, False, str(why), "fix the node"))
            continue
        reply = outcome.value
        line = next((x for x in reply.out.splitlines() if x.startswith("meshkit-probe ")), None)
        ok = reply.code == 0 and line is not None and line.endswith("ok=True")
        detail = line or (reply.err.strip().splitlines() or [f"exit {reply.code}"])[-1]
        detail = detail.removeprefix("meshkit-probe ")
        checks.append(
            Check(
                "collective",
                host.label,
                None,
                ok,
                detail[:300],
                ""
                if ok
                else "see the failing checks above; set GLOO_SOCKET_IFNAME/"
                "NCCL_SOCKET_IFNAME if gloo/NCCL picked the wrong interface",
            )
        )
    return checks


# ---- orchestration ------------------------------------------------------------------------


def run(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    *,
    verify: Verify | None = None,
    collective: bool = True,
    probe_seconds: float = PROBE_SECONDS,
    port_may_move: bool = False,
    envs: Envs | None = None,
    facts: Facts | None = None,
) -> Report:
    """Every check, in the order a training job would hit them. ``verify`` (the SSH N x N check)
    and ``collective`` are the slow parts; ``quick`` (train --doctor) leaves both out. ``envs``
    and ``facts``: rounds the caller ran already (train runs each once)."""
    report = Report([h.label for h in hosts])
    checks = report.checks
    if verify is not None:
        checks += ssh_checks(hosts, verify())

    if envs is None:
        envs = env_round(pool, job)
    views = {h: read_env(envs.get(h), pool.failures.get(h)) for h in hosts}
    checks += env_checks(hosts, views)

    # facts: the master writes the shared-workdir marker, then the others look for it (unless
    # the caller's round did: train's, with the marker written by the machine it runs on)
    own = facts is None
    if facts is None:
        facts = facts_round(pool, job.workdir, hosts, hosts[0])
    checks += fact_checks(hosts, facts, pool.failures, hosts[0].slots, job.sync)
    marker = facts.marker if own else None

    try:
        checks += network_checks(pool, job, hosts, views, port_may_move)
    finally:
        pool.call_all("", lambda h: DoneRequest(marker if h == hosts[0] else None), DoneReply)

    if collective:
        blocked = any(not c.ok for c in checks if c.check in ("master port", "reach", "rank"))
        checks += collective_round(pool, job, hosts, blocked, probe_seconds)
    checks.sort(key=lambda c: ORDER.index(c.check) if c.check in ORDER else len(ORDER))
    return report


def collective_round(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    blocked: bool,
    probe_seconds: float,
    extra: Sequence[str] = (),
) -> list[Check]:
    """The collective probe through ``meshkit run`` on every node (``extra``: its flags); not
    run (and said so) when the network checks before it failed."""
    if blocked:
        why = "not run: the network checks above failed"
        return [
            Check("collective", hosts[0].label, None, False, why, "fix the failures above first")
        ]
    argv = [
        job.python,
        "-m",
        "meshkit.templates.collective_probe",
        "--timeout",
        f"{probe_seconds:g}",
    ]
    run_argv = job.meshkit_argv("run", "--cmd", shlex.join([*argv, *extra]))
    replies = pool.call_all(
        "collective",
        lambda h: ProbeRequest(job.workdir, run_argv, probe_seconds + 30),
        ProbeReply,
        timeout=probe_seconds + 60,
    )
    return collective_checks(hosts, replies, pool.failures)


def quick(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    envs: Envs | None = None,
    facts: Facts | None = None,
) -> Report:
    """The quick parts, for ``train --doctor``: everything but the N x N SSH check (the train
    connections just proved the controller's side) and the collective probe; a busy master port
    is only a note, since train then moves to a free one."""
    return run(
        pool,
        job,
        hosts,
        verify=None,
        collective=False,
        port_may_move=True,
        envs=envs,
        facts=facts,
    )


def network_checks(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    views: dict[Host, NodeView],
    port_may_move: bool = False,
) -> list[Check]:
    """The master port free on the master and reachable from every node; every node reaching
    every other on the interface its backends will use."""
    checks: list[Check] = []
    master, port = hosts[0], job.master_port
    held = pool.call_all(
        "port", lambda h: ListenRequest(None, port, LISTEN_SECONDS), ListenReply, [master]
    )
    checks.append(port_check(master, port, held.get(master), port_may_move))
    answer = held.get(master)
    port_open = answer is not None and answer.value is not None and answer.value.error is None
    ok_hosts = [h for h in hosts if views[h].error is None]
    listens = pool.call_all(
        "listen",
        lambda h: ListenRequest(views[h].ifname, 0, LISTEN_SECONDS),
        ListenReply,
        ok_hosts,
    )
    targets: dict[Host, ProbeTarget] = {}
    for h in ok_hosts:
        outcome = listens.get(h)
        if outcome is None or outcome.value is None or outcome.value.error:
            why = (outcome.value.error if outcome and outcome.value else None) or (
                outcome.error if outcome else "unreachable"
            )
            checks.append(
                Check(
                    "reach",
                    h.label,
                    None,
                    False,
                    f"cannot listen: {why}",
                    "fix the node's interface",
                )
            )
            continue
        address = outcome.value.address
        targets[h] = ProbeTarget(h.label, h.host if address == "*" else address, outcome.value.port)

    def connects(h: Host) -> ConnectRequest:
        peers = [t for p, t in targets.items() if p != h]
        if port_open and h != master:
            # to MASTER_ADDR as this node's env spells it, as torchrun's store client will
            peers.append(ProbeTarget(master.label, views[h].master_addr or master.host, port))
        return ConnectRequest(peers, CONNECT_SECONDS)

    replies = pool.call_all("reach", connects, ConnectReply, ok_hosts, timeout=CONNECT_SECONDS + 30)
    peer_replies = {
        h: _only(o, lambda r: r.port != port or r.label != master.label) for h, o in replies.items()
    }
    master_replies = {
        h: _only(o, lambda r: r.port == port and r.label == master.label)
        for h, o in replies.items()
        if h != master
    }
    if port_open:
        checks += reach_checks(hosts, port, master_replies, pool.failures, "master port")
    checks += reach_checks(hosts, port, peer_replies, pool.failures, "reach")
    return checks


def _only(
    outcome: Outcome[ConnectReply], keep: Callable[[ConnectResult], bool]
) -> Outcome[ConnectReply]:
    if outcome.value is None:
        return outcome
    return Outcome(ConnectReply([r for r in outcome.value.results if keep(r)]))


# ---- doctor --bandwidth ---------------------------------------------------------------------


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``n`` nodes once, in rounds of disjoint pairs (the circle method): n-1
    rounds of n/2 pairs; for odd n, n rounds, each with one node out."""
    ring = [*range(n), *([-1] if n % 2 else [])]
    rounds = []
    for _ in range(len(ring) - 1):
        half = len(ring) // 2
        pairs = zip(ring[:half], reversed(ring[half:]))
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if -1 not in (a, b)])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def disjoint(pairs: Sequence[tuple[Host, Host]]) -> list[list[tuple[Host, Host]]]:
    """``pairs`` in rounds in which no node is twice (greedy: each into the first that has room)."""
    rounds: list[list[tuple[Host, Host]]] = []
    for pair in pairs:
        free = next((r for r in rounds if not {*pair} & {h for p in r for h in p}), None)
        free.append(pair) if free is not None else rounds.append([pair])
    return rounds


def _better(r: BandwidthResult) -> tuple[bool, float]:
    return r.error is None, min(r.sent, r.received)


def rate_text(bits: float) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.0f} bit/s"


def _subnets(reply: BandwidthReply) -> dict[str, tuple[str, str]]:
    """A node's networks: subnet -> (interface, address)."""
    found: dict[str, tuple[str, str]] = {}
    for line in reply.networks:
        name, _, cidr = line.partition(" ")
        with contextlib.suppress(ValueError):
            found.setdefault(str(ipaddress.IPv4Interface(cidr).network), (name, cidr.split("/")[0]))
    return found


def pair_targets(
    client: BandwidthReply, server: BandwidthReply, server_if: str | None, label: str, port: int
) -> list[BandwidthTarget]:
    """The client's tests towards the server: one per network both are on (the server's exported
    interface's first), never to an address the client holds itself (docker0's 172.17.0.1)."""
    mine, theirs = _subnets(client), _subnets(server)
    own = {address for _, address in mine.values()}
    shared = [net for net in theirs if net in mine and theirs[net][1] not in own]
    shared.sort(key=lambda net: theirs[net][0] != server_if)
    return [BandwidthTarget(label, net, theirs[net][1], port) for net in shared]


def bandwidth_checks(
    hosts: Sequence[Host],
    results: dict[tuple[Host, Host], list[BandwidthResult]],
    ifnames: dict[Host, str | None],
    min_ratio: float,
    min_rate: float,
) -> tuple[list[Check], Bandwidth]:
    """One check per pair on the exported network (``results``: (client, server) -> its tests,
    that network's first): slow below ``min_ratio`` x the cluster's median or below ``min_rate``
    (bits/s). The median is over the nodes of each node's median rate: one slow node of three is
    still held to what the others reach, and a pair that ran alone in its round (beside a slow
    one, on a CPU-bound network) does not raise it; a node all of whose pairs are slow is named."""
    rates, per_node = {}, {h: list[float]() for h in hosts}
    for (client, server), (r, *_) in results.items():
        if r.error is None:
            rates[client, server], rates[server, client] = r.sent * 8, r.received * 8
    for (a, b), value in rates.items():
        per_node[a].append(value)
        per_node[b].append(value)
    median = statistics.median([statistics.median(v) for v in per_node.values() if v] or [0.0])
    floor = max(min_ratio * median, min_rate)
    pairs = sorted(results, key=lambda p: (hosts.index(p[0]), hosts.index(p[1])))
    slow = {p for p in pairs if min(rates.get(p, 0), rates.get(p[::-1], 0)) < floor}
    mates = {h: {p for p in pairs if h in p} for h in hosts}
    nodes = [h for h in hosts if len(hosts) > 2 and mates[h] and mates[h] <= slow]
    checks = []
    for a, b in pairs:
        r, culprit = results[a, b][0], next((h.label for h in nodes if h in (a, b)), None)
        detail = (
            f"failed: {r.error}"
            if r.error
            else (
                f"node->peer {rate_text(rates[a, b])}, peer->node {rate_text(rates[b, a])} "
                f"on {ifnames.get(a) or r.network}; median {rate_text(median)}"
            )
        )
        fix = (
            f"every pair of {culprit} is slow: look at that node's NIC (ethtool: speed, duplex, "
            "errors), cable and switch port"
            if culprit
            else "look at this link: cable, switch ports and negotiated speed on both ends "
            "(ethtool), or other traffic on it"
        ) * ((a, b) in slow)
        checks.append(Check("bandwidth", a.label, b.label, (a, b) not in slow, detail, fix))
    matrix = {(a.label, b.label): v for (a, b), v in rates.items()}
    return checks, Bandwidth(matrix, median, [h.label for h in nodes])


def network_checks_bw(
    hosts: Sequence[Host],
    replies: dict[Host, BandwidthReply],
    results: dict[tuple[Host, Host], list[BandwidthResult]],
    ifnames: dict[Host, str | None],
    min_ratio: float,
) -> list[Check]:
    """Per node with more than one network: each one's rate (its fastest pair there, the slower
    direction), which is fastest, and whether the exported interface is it (a failure when another
    is faster by more than 1/min_ratio on every pair, measured in turn); and its InfiniBand
    devices."""
    checks = []
    for host in hosts:
        reply = replies.get(host, BandwidthReply([], [], [], False))
        names = {net: name for net, (name, _) in _subnets(reply).items()}
        mine = ifnames.get(host) or ""
        speed: dict[str, float] = {}
        faster: dict[str, bool] = {}  # network -> faster than the exported one on every pair
        for pair, tests in results.items():
            rate = {names.get(r.network, r.network): min(r.sent, r.received) * 8 for r in tests}
            for net, value in rate.items() if host in pair and len(tests) > 1 else ():
                speed[net] = max(speed.get(net, 0.0), value)
                slow = rate.get(mine, 0.0) < min_ratio * value
                faster[net] = net != mine and faster.get(net, True) and slow
        if len(speed) > 1:
            fastest = max(speed, key=lambda n: (faster[n], speed[n]))
            detail = ", ".join(
                f"{n}{' (exported)' * (n == mine)} {rate_text(v)}" for n, v in speed.items()
            )
            detail += (
                f"; fastest: {fastest}" if fastest != mine else "; the exported one is fastest"
            )
            fix = (
                f"list this node by its {fastest} address in the hostfile, or set "
                f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={fastest} (config meshkit.env)"
            ) * faster[fastest]
            checks.append(Check("networks", host.label, None, not faster[fastest], detail, fix))
        active = ",".join(d.split()[0] for d in reply.infiniband if d.endswith("ACTIVE"))
        found = ", ".join(reply.infiniband)
        detail = f"{found}; NCCL_IB_HCA={active or '(none active)'}" if found else "none found"
        checks.append(Check("infiniband", host.label, None, True, detail))
    return checks


def bandwidth_round(
    pool: NodePool,
    pairs: dict[Host, Host],
    replies: dict[Host, BandwidthReply],
    ifnames: dict[Host, str | None],
    networks: int = 64,
) -> dict[tuple[Host, Host], list[BandwidthResult]]:
    """One round: each server (``pairs``' values) listens, each client tests towards it (on its
    first ``networks`` networks in common)."""
    bound = BW_REPEATS * 2 * (BW_SECONDS + 5)  # one test's worst case (a drain after each try)
    listens = pool.call_all(
        "listen",
        lambda h: ListenRequest(None, 0, bound * 4, bandwidth=True),
        ListenReply,
        list(pairs.values()),
    )
    tests, results = {}, {}
    for client, server in pairs.items():
        got = listens.get(server, Outcome[ListenReply](error="unreachable"))
        why = got.value.error if got.value else got.error
        port = got.value.port if got.value else 0
        tests[client] = (
            []
            if why
            else pair_targets(replies[client], replies[server], ifnames[server], server.label, port)
        )
        why = f"{server.label} cannot listen: {why}" if why else "no network in common"
        results[client, server] = [BandwidthResult(server.label, "", 0.0, 0.0, why)]
    done = pool.call_all(
        "bandwidth",
        lambda h: (
            BandwidthRequest(tests[h], BW_SECONDS, BW_BYTES, BW_REPEATS) if tests[h] else None
        ),
        BandwidthReply,
        list(pairs),
        timeout=bound * max((len(t) for t in tests.values()), default=1) + 30,
    )
    for (client, server), reply in ((p, done[p[0]]) for p in pairs.items() if p[0] in done):
        failed = [BandwidthResult(server.label, "", 0.0, 0.0, str(reply.error))]
        results[client, server] = reply.value.results if reply.value else failed
    return results


def bandwidth(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    *,
    min_ratio: float = 0.5,
    min_rate: float = 0.0,
    probe_seconds: float = PROBE_SECONDS,
) -> Report:
    """``doctor --bandwidth``: every pair's throughput both ways, on every network the pair
    shares, measured by the agents in rounds of disjoint pairs; then one timed all_reduce."""
    envs = env_round(pool, job)
    views = {h: read_env(envs.get(h), pool.failures.get(h)) for h in hosts}
    checks = [c for c in env_checks(hosts, views) if not c.ok or c.check == "interface"]
    ifnames = {h: views[h].ifname for h in hosts}
    found = pool.call_all("networks", lambda h: BandwidthRequest([], 0, 0, 0), BandwidthReply)
    replies = {h: o.value for h, o in found.items() if o.value is not None}
    for h in hosts:
        if h not in replies:
            why = unanswered(found.get(h), h, pool.failures)
            checks.append(Check("bandwidth", h.label, None, False, str(why), "fix the node"))
    results: dict[tuple[Host, Host], list[BandwidthResult]] = {}
    todo = [[(hosts[a], hosts[b]) for a, b in r] for r in pair_rounds(len(hosts))]
    try:
        for networks in (64, 1, 1):
            for round_ in todo:
                pairs = {a: b for a, b in round_ if {a, b} <= set(replies)}
                for pair, got in bandwidth_round(pool, pairs, replies, ifnames, networks).items():
                    old = results.setdefault(pair, got)
                    results[pair] = [max(two, key=_better) for two in zip(old, got)] + old[
                        len(got) :
                    ]
            # a pair found slow is measured again (twice at most), later and on the exported
            # network only: on a shared machine one busy second must not name a link (the better
            # measurement counts; a slow link stays slow)
            verdict, _ = bandwidth_checks(hosts, results, ifnames, min_ratio, min_rate)
            slow = {(c.node, c.peer) for c in verdict if not c.ok}
            todo = disjoint([(a, b) for a, b in results if (a.label, b.label) in slow])
    finally:
        pool.call_all("", lambda h: DoneRequest(None), DoneReply)
    pair_checks, matrix = bandwidth_checks(hosts, results, ifnames, min_ratio, min_rate)
    checks += pair_checks + network_checks_bw(hosts, replies, results, ifnames, min_ratio)
    lacking = [h.label for h in hosts if h not in replies or not replies[h].torch]
    if lacking:
        why = f"not run: no torch on {', '.join(lacking)}"
        checks.append(Check("collective", hosts[0].label, None, True, why))
    else:
        blocked = any(
            c.check == "rank" or c.detail.startswith("failed:") for c in checks if not c.ok
        )
        # sized to take about a second on the slowest link measured (1 to 64 MiB)
        size = int(min(max(min(matrix.rates.values(), default=0) / 16, 1 << 20), 64 << 20))
        probe = collective_round(pool, job, hosts, blocked, probe_seconds, ["--bytes", str(size)])
        checks += probe
        words = [w for c in probe for w in c.detail.split() if w.startswith("busbw=")]
        matrix = replace(matrix, busbw=min((float(w[6:]) for w in words), default=None))
    checks.sort(key=lambda c: ORDER.index(c.check) if c.check in ORDER else len(ORDER))
    return Report([h.label for h in hosts], checks, matrix)
