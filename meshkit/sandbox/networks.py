"""Real-world networks for the sandbox: what breaks multi-node training on real clusters.

The options (``layout.NetworkOptions``, all off by default): ``second``, a second network per node
(its own bridge and subnet), as a storage or management network beside the hostfile's; ``ifnames``,
interface names that differ between nodes (``eth0``, ``ens3``, ``eno1``, ...), so one
``GLOO_SOCKET_IFNAME`` cannot serve every node; ``docker``, a ``docker0`` bridge with the same
address (172.17.0.1/16) in every node; ``debian_hosts``, the Debian ``127.0.1.1 <hostname>`` line in
every node's /etc/hosts. They are stored in state.json, so ``load`` gives them back.

``cut``/``mend`` take the link between two nodes down and up again (an ``unreachable`` route in each
node's namespace: iproute2 alone, no firewall tools). ``shape``/``unshape`` slow a link or a node
with traffic control: an htb class and a u32 filter for the peer on both ends of a link, or tbf on
both ends of a node's veth. ``silence``/``unsilence`` make a node answer nothing, as a machine
that is off: a ``blackhole`` routing rule in its namespace drops whatever it would send.
"""

from __future__ import annotations

import ipaddress
import json

from ..errors import SandboxError
from .layout import Layout, NetworkOptions, Node
from .system import ip_batch, run

DOCKER_BRIDGE = "docker0"
DOCKER_ADDRESS = "172.17.0.1/16"
PRIMARY_NAMES = ("eth0", "ens3", "eno1")
SECOND_NAMES = ("eth1", "ens4", "eno2")


def primary_ifname(opts: NetworkOptions, index: int) -> str:
    """The name of node ``index``'s interface on the hostfile's network."""
    if not opts.ifnames:
        return "eth0"
    return PRIMARY_NAMES[index % len(PRIMARY_NAMES)]


def second_ifname(opts: NetworkOptions, index: int) -> str:
    if not opts.ifnames:
        return "eth1"
    return SECOND_NAMES[index % len(SECOND_NAMES)]


def second_subnet(sandbox: Layout) -> ipaddress.IPv4Network:
    """The first subnet moved up by one in its second octet (10.77.5.0/24 -> 10.78.5.0/24)."""
    return second_network(sandbox.subnet)


def second_network(subnet: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    base = int(subnet.network_address) + (1 << 16)
    return ipaddress.IPv4Network((base & 0xFFFFFFFF, subnet.prefixlen))


def second_address(sandbox: Layout, node: Node) -> str:
    offset = int(ipaddress.IPv4Address(node.address)) - int(sandbox.subnet.network_address)
    return str(second_subnet(sandbox).network_address + offset)


def addresses(sandbox: Layout, node: Node) -> list[str]:
    """Every address of a node that other nodes can reach."""
    found = [node.address]
    if sandbox.networks.second:
        found.append(second_address(sandbox, node))
    return found


def hosts_text(sandbox: Layout, node: Node) -> str:
    """The node's /etc/hosts: the Debian installer's ``127.0.1.1`` line first when asked, as on a
    freshly installed Debian/Ubuntu machine."""
    lines = ["127.0.0.1 localhost"]
    if sandbox.networks.debian_hosts:
        lines.append(f"127.0.1.1 {node.name}")
    lines.append("::1 localhost ip6-localhost ip6-loopback")
    lines += [f"{other.address} {other.name}" for other in sandbox.nodes]
    return "\n".join(lines) + "\n"


def _bridge(name: str, address: str) -> list[str]:
    return [f"link add {name} type bridge", f"addr add {address} dev {name}", f"link set {name} up"]


def _veth(host: str, inside: str, node: Node, bridge: str) -> list[str]:
    """A veth pair: ``host`` on ``bridge``, ``inside`` in ``node``."""
    add = f"link add {host} type veth peer name {inside} netns {node.netns}"
    return [add, f"link set {host} master {bridge}", f"link set {host} up"]


def host_batch(sandbox: Layout) -> list[str]:
    """``ip -batch`` lines on the host: each network's bridge and each node's veth onto it."""
    prefix = sandbox.subnet.prefixlen
    opts = sandbox.networks
    batch = _bridge(sandbox.bridge, f"{sandbox.controller_address}/{prefix}")
    for node in sandbox.nodes:
        batch += _veth(node.veth, primary_ifname(opts, node.index), node, sandbox.bridge)
    if opts.second:
        second_controller = second_subnet(sandbox).network_address + 1
        batch += _bridge(sandbox.second_bridge, f"{second_controller}/{prefix}")
        for node in sandbox.nodes:
            inside = second_ifname(opts, node.index)
            batch += _veth(sandbox.second_veth(node), inside, node, sandbox.second_bridge)
    return batch


def node_batch(sandbox: Layout, node: Node) -> list[str]:
    """``ip -n NETNS -batch`` lines inside a node: loopback, its side of each network, docker0."""
    prefix = sandbox.subnet.prefixlen
    primary = primary_ifname(sandbox.networks, node.index)
    batch = [
        "link set lo up",
        f"addr add {node.address}/{prefix} dev {primary}",
        f"link set {primary} up",
    ]
    if sandbox.networks.second:
        second = second_ifname(sandbox.networks, node.index)
        batch += [
            f"addr add {second_address(sandbox, node)}/{prefix} dev {second}",
            f"link set {second} up",
        ]
    if sandbox.networks.docker:
        batch += _bridge(DOCKER_BRIDGE, DOCKER_ADDRESS)
    return batch


def add_docker(sandbox: Layout) -> None:
    """docker0 on every node of a running sandbox, as when Docker is installed after the cluster
    was set up (safe to repeat)."""
    for node in sandbox.nodes:
        shown = run(["ip", "-n", node.netns, "link", "show", DOCKER_BRIDGE], check=False)
        if not shown.stdout:
            ip_batch(_bridge(DOCKER_BRIDGE, DOCKER_ADDRESS), node.netns)


def _both_ways(sandbox: Layout, one: int, other: int) -> list[tuple[Node, Node]]:
    """The link between two different nodes as (here, there) from each end."""
    one_node = sandbox.node(one)
    other_node = sandbox.node(other)
    if one == other:
        raise SandboxError(f"nodes {one} and {other}: name two different nodes")
    return [(one_node, other_node), (other_node, one_node)]


def _routes(sandbox: Layout, one: int, other: int, verb: str) -> list[list[str]]:
    """The ``ip`` commands that add or delete the cut between ``one`` and ``other``."""
    commands = []
    for here, there in _both_ways(sandbox, one, other):
        for address in addresses(sandbox, there):
            commands.append(["ip", "-n", here.netns, "route", verb, "unreachable", f"{address}/32"])
    return commands


def cut(sandbox: Layout, one: int, other: int) -> None:
    """Take the link between nodes ``one`` and ``other`` down, both ways, on every network: each
    drops what it would send to the other (connections fail with "No route to host")."""
    for argv in _routes(sandbox, one, other, "replace"):
        run(argv)


def mend(sandbox: Layout, one: int, other: int) -> None:
    """Undo ``cut`` (safe when there is no cut)."""
    for argv in _routes(sandbox, one, other, "del"):
        run(argv, check=False)


def cuts(sandbox: Layout) -> list[tuple[int, int]]:
    """The node pairs currently cut (read from the namespaces' routes)."""
    by_address = {}
    for node in sandbox.nodes:
        for address in addresses(sandbox, node):
            by_address[address] = node.index
    found: set[tuple[int, int]] = set()
    for node in sandbox.nodes:
        shown = run(
            ["ip", "-n", node.netns, "-j", "route", "show", "type", "unreachable"], check=False
        )
        for route in json.loads(shown.stdout or "[]"):
            other = by_address.get(str(route.get("dst", "")))
            if other is not None:
                found.add((min(node.index, other), max(node.index, other)))
    return sorted(found)


# A rule before the main table (after the local one, so that packets still arrive) that discards
# every packet the node sends: its kernel's resets and ICMP errors included, so connections to it
# time out, as to a machine that is off, instead of being refused. Its ARP still answers, which
# is what a switch's cache does for a while, and spares its peers an early "No route to host".
SILENT_RULE = ["pref", "1", "blackhole"]
FAMILIES = ("-4", "-6")


def silence(node: Node) -> None:
    """Make the node answer nothing on any of its addresses (safe to repeat)."""
    for family in FAMILIES:
        if not _silent(node, family):
            run(["ip", family, "-n", node.netns, "rule", "add", *SILENT_RULE])


def unsilence(node: Node) -> None:
    """Undo ``silence`` (safe when the node is not silent)."""
    for family in FAMILIES:
        while _silent(node, family):
            run(["ip", family, "-n", node.netns, "rule", "del", *SILENT_RULE])


def silent(node: Node) -> bool:
    """Whether ``silence`` holds the node."""
    return _silent(node, "-4")


def _silent(node: Node, family: str) -> bool:
    shown = run(["ip", family, "-n", node.netns, "-j", "rule", "show", "pref", "1"], check=False)
    rules = json.loads(shown.stdout or "[]")
    return any(rule.get("action") == "blackhole" for rule in rules)


def _tc(netns: str | None, *args: str, check: bool = True) -> str:
    where = []
    if netns:
        where = ["-n", netns]
    return run(["tc", *where, *args], check=check).stdout


def shape(sandbox: Layout, index: int, peer: int | None, bits: int) -> None:
    """Slow node ``index`` to ``bits``/s: its link to ``peer`` both ways (an htb class and a
    filter for the other's address on each end), or, without a peer, everything it sends and
    receives (tbf on its interface, and on the veth's host end, which is its way in)."""
    node = sandbox.node(index)
    if peer is None:
        burst = max(bits // 8 // 250, 16000)  # a 4 ms burst at least: tbf needs rate/HZ
        tbf = ["root", "tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]
        _tc(node.netns, "qdisc", "replace", "dev", primary_ifname(sandbox.networks, index), *tbf)
        _tc(None, "qdisc", "replace", "dev", node.veth, *tbf)
        return
    for here, there in _both_ways(sandbox, index, peer):
        device = ["dev", primary_ifname(sandbox.networks, here.index)]
        class_id = f"1:{there.index + 10}"
        qdisc = _tc(here.netns, "qdisc", "show", *device, "root")
        if " htb 1: " not in qdisc + " ":
            _tc(here.netns, "qdisc", "replace", *device, "root", "handle", "1:", "htb")
        rate = ["rate", f"{bits}bit", "ceil", f"{bits}bit"]
        _tc(
            here.netns,
            "class",
            "replace",
            *device,
            "parent",
            "1:",
            "classid",
            class_id,
            "htb",
            *rate,
        )
        priority = ["parent", "1:", "protocol", "ip", "prio", str(there.index + 1)]
        _tc(here.netns, "filter", "del", *device, *priority, check=False)
        match = ["u32", "match", "ip", "dst", f"{there.address}/32", "flowid", class_id]
        _tc(here.netns, "filter", "add", *device, *priority, *match)


def unshape(sandbox: Layout) -> None:
    """Remove every shaping of ``shape`` (safe when there is none)."""
    for node in sandbox.nodes:
        primary = primary_ifname(sandbox.networks, node.index)
        _tc(node.netns, "qdisc", "del", "dev", primary, "root", check=False)
        _tc(None, "qdisc", "del", "dev", node.veth, "root", check=False)
