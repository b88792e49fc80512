"""Real-world networks for the sandbox: what breaks multi-node training on real clusters.

Options (``layout.Options``, all off by default): ``second``, a second network per node (its own
bridge and subnet), as a storage or management network beside the hostfile's; ``ifnames``,
interface names that differ between nodes (``eth0``, ``ens3``, ``eno1``, ...), so one
``GLOO_SOCKET_IFNAME`` cannot serve every node; ``docker``, a ``docker0`` bridge with the same
address (172.17.0.1/16) in every node; ``debian_hosts``, the Debian ``127.0.1.1 <hostname>`` line
in every node's /etc/hosts. They are stored in state.json, so ``load`` gives them back.

``cut``/``mend`` take the link between two nodes down and up again (an ``unreachable`` route in each
node's namespace: iproute2 alone, no firewall tools). ``shape``/``unshape`` slow a link or a node
with traffic control: an htb class and a u32 filter for the peer on both ends of a link, or tbf on
both ends of a node's veth.
"""

from __future__ import annotations

import ipaddress
import json

from ..errors import SandboxError
from .layout import Layout, Node, Options
from .system import ip_batch, run

DOCKER_BRIDGE, DOCKER_ADDRESS = "docker0", "172.17.0.1/16"
PRIMARY_NAMES = ("eth0", "ens3", "eno1")
SECOND_NAMES = ("eth1", "ens4", "eno2")


def primary_ifname(opts: Options, index: int) -> str:
    """The name of node ``index``'s interface on the hostfile's network."""
    return PRIMARY_NAMES[index % len(PRIMARY_NAMES)] if opts.ifnames else "eth0"


def second_ifname(opts: Options, index: int) -> str:
    return SECOND_NAMES[index % len(SECOND_NAMES)] if opts.ifnames else "eth1"


def second_subnet(lay: Layout) -> ipaddress.IPv4Network:
    """The first subnet moved up by one in its second octet (10.77.5.0/24 -> 10.78.5.0/24)."""
    base = int(lay.subnet.network_address) + (1 << 16)
    return ipaddress.IPv4Network((base & 0xFFFFFFFF, lay.subnet.prefixlen))


def second_address(lay: Layout, node: Node) -> str:
    offset = int(ipaddress.IPv4Address(node.address)) - int(lay.subnet.network_address)
    return str(second_subnet(lay).network_address + offset)


def addresses(lay: Layout, node: Node) -> list[str]:
    """Every address of a node that other nodes can reach."""
    return [node.address, *([second_address(lay, node)] if lay.networks.second else [])]


def hosts_text(lay: Layout, node: Node) -> str:
    """The node's /etc/hosts: the Debian installer's ``127.0.1.1`` line first when asked, as on a
    freshly installed Debian/Ubuntu machine."""
    lines = ["127.0.0.1 localhost"]
    if lay.networks.debian_hosts:
        lines.append(f"127.0.1.1 {node.name}")
    lines.append("::1 localhost ip6-localhost ip6-loopback")
    lines += [f"{n.address} {n.name}" for n in lay.nodes]
    return "\n".join(lines) + "\n"


def _bridge(name: str, address: str) -> list[str]:
    return [f"link add {name} type bridge", f"addr add {address} dev {name}", f"link set {name} up"]


def _veth(host: str, inside: str, node: Node, bridge: str) -> list[str]:
    """A veth pair: ``host`` on ``bridge``, ``inside`` in ``node``."""
    add = f"link add {host} type veth peer name {inside} netns {node.netns}"
    return [add, f"link set {host} master {bridge}", f"link set {host} up"]


def host_batch(lay: Layout) -> list[str]:
    """``ip -batch`` lines on the host: each network's bridge and each node's veth onto it."""
    prefix, opts = lay.subnet.prefixlen, lay.networks
    batch = _bridge(lay.bridge, f"{lay.controller_address}/{prefix}")
    for node in lay.nodes:
        batch += _veth(node.veth, primary_ifname(opts, node.index), node, lay.bridge)
    if opts.second:
        batch += _bridge(lay.second_bridge, f"{second_subnet(lay).network_address + 1}/{prefix}")
        for node in lay.nodes:
            inside = second_ifname(opts, node.index)
            batch += _veth(lay.second_veth(node), inside, node, lay.second_bridge)
    return batch


def node_batch(lay: Layout, node: Node) -> list[str]:
    """``ip -n NETNS -batch`` lines inside a node: loopback, its side of each network, docker0."""
    prefix, eth = lay.subnet.prefixlen, primary_ifname(lay.networks, node.index)
    batch = ["link set lo up", f"addr add {node.address}/{prefix} dev {eth}", f"link set {eth} up"]
    if lay.networks.second:
        eth = second_ifname(lay.networks, node.index)
        batch += [f"addr add {second_address(lay, node)}/{prefix} dev {eth}", f"link set {eth} up"]
    return batch + (_bridge(DOCKER_BRIDGE, DOCKER_ADDRESS) if lay.networks.docker else [])


def add_docker(lay: Layout) -> None:
    """docker0 on every node of a running sandbox, as when Docker is installed after the cluster
    was set up (safe to repeat)."""
    for node in lay.nodes:
        if not run(["ip", "-n", node.netns, "link", "show", DOCKER_BRIDGE], check=False).stdout:
            ip_batch(_bridge(DOCKER_BRIDGE, DOCKER_ADDRESS), node.netns)


def _pair(lay: Layout, a: int, b: int) -> tuple[Node, Node]:
    pair = lay.node(a), lay.node(b)
    if a == b:
        raise SandboxError(f"nodes {a} and {b}: name two different nodes")
    return pair


def _routes(lay: Layout, a: int, b: int, verb: str) -> list[list[str]]:
    """The ``ip`` commands that add or delete the cut between ``a`` and ``b``."""
    one, two = _pair(lay, a, b)
    return [
        ["ip", "-n", here.netns, "route", verb, "unreachable", f"{addr}/32"]
        for here, there in ((one, two), (two, one))
        for addr in addresses(lay, there)
    ]


def cut(lay: Layout, a: int, b: int) -> None:
    """Take the link between nodes ``a`` and ``b`` down, both ways, on every network: each drops
    what it would send to the other (connections fail with "No route to host")."""
    for argv in _routes(lay, a, b, "replace"):
        run(argv)


def mend(lay: Layout, a: int, b: int) -> None:
    """Undo ``cut`` (safe when there is no cut)."""
    for argv in _routes(lay, a, b, "del"):
        run(argv, check=False)


def cuts(lay: Layout) -> list[tuple[int, int]]:
    """The node pairs currently cut (read from the namespaces' routes)."""
    by_address = {addr: n.index for n in lay.nodes for addr in addresses(lay, n)}
    found: set[tuple[int, int]] = set()
    for node in lay.nodes:
        shown = run(
            ["ip", "-n", node.netns, "-j", "route", "show", "type", "unreachable"], check=False
        )
        for route in json.loads(shown.stdout or "[]"):
            other = by_address.get(str(route.get("dst", "")))
            if other is not None:
                found.add((min(node.index, other), max(node.index, other)))
    return sorted(found)


def _tc(netns: str | None, *args: str, check: bool = True) -> str:
    return run(["tc", *(["-n", netns] if netns else []), *args], check=check).stdout


def shape(lay: Layout, index: int, peer: int | None, bits: int) -> None:
    """Slow node ``index`` to ``bits``/s: its link to ``peer`` both ways (an htb class and a
    filter for the other's address on each end), or, without a peer, everything it sends and
    receives (tbf on its interface, and on the veth's host end, which is its way in)."""
    node = lay.node(index)
    if peer is None:
        burst = max(bits // 8 // 250, 16000)  # a 4 ms burst at least: tbf needs rate/HZ
        tbf = ["root", "tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]
        _tc(node.netns, "qdisc", "replace", "dev", primary_ifname(lay.networks, index), *tbf)
        _tc(None, "qdisc", "replace", "dev", node.veth, *tbf)
        return
    one, two = _pair(lay, index, peer)
    for here, there in ((one, two), (two, one)):
        dev, klass = ["dev", primary_ifname(lay.networks, here.index)], f"1:{there.index + 10}"
        if " htb 1: " not in _tc(here.netns, "qdisc", "show", *dev, "root") + " ":
            _tc(here.netns, "qdisc", "replace", *dev, "root", "handle", "1:", "htb")
        _tc(here.netns, "class", "replace", *dev, "parent", "1:", "classid", klass, "htb",
            "rate", f"{bits}bit", "ceil", f"{bits}bit")  # fmt: skip
        prio = ["parent", "1:", "protocol", "ip", "prio", str(there.index + 1)]
        _tc(here.netns, "filter", "del", *dev, *prio, check=False)
        _tc(here.netns, "filter", "add", *dev, *prio, "u32", "match", "ip", "dst",
            f"{there.address}/32", "flowid", klass)  # fmt: skip


def unshape(lay: Layout) -> None:
    """Remove every shaping of ``shape`` (safe when there is none)."""
    for node in lay.nodes:
        _tc(node.netns, "qdisc", "del", "dev", primary_ifname(lay.networks, node.index), "root",
            check=False)  # fmt: skip
        _tc(None, "qdisc", "del", "dev", node.veth, "root", check=False)
