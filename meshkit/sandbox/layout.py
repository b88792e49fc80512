"""Where everything of one sandbox lives: pure arithmetic on its name, directory, subnet and size.

Several sandboxes run side by side, each under its own name: its own bridges, namespaces, veths,
subnet and directory. The sandbox named ``default`` (a plain ``meshkit sandbox.up``) has the short
names without a sandbox name in them (bridge ``mkbr0``, namespaces ``meshkit-n<i>``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import SandboxError

DEFAULT = "default"
FIRST_HOST = 11  # node i is subnet + 11 + i; the controller (bridge) is subnet + 1
# A /24 holds nodes .11 to .254 (.255 is the broadcast address): 244 nodes.
MAX_NODES = 256 - FIRST_HOST - 1
NAME_MAX = 8
# Linux interface names are at most 15 characters (IFNAMSIZ 16 with the NUL): the longest
# sandbox-owned name is a veth's, "mk" + name + "-" + node index, i.e. 2 + 8 + 1 + 3 = 14 at
# MAX_NODES; ``layout`` checks every name it would create.
IFNAME_MAX = 15
_NAME = re.compile(rf"^[a-z][a-z0-9]{{0,{NAME_MAX - 1}}}$")

# The nodes' ~/.bashrc. sshd starts the user's shell for every exec channel (and for an external
# SFTP server), and bash reads ~/.bashrc there, interactive or not.
BASHRCS = {
    "minimal": "a one-line ~/.bashrc (the host's does not run on the nodes)",
    "conda": (
        "a conda-init-like ~/.bashrc: about 0.1 s of CPU per shell (a Python hook, as `conda "
        "init` and `pyenv init` leave on ML nodes, with no interactive guard), every shell "
        "counted in the node's /tmp/.meshkit-shells; sshd runs the Debian sftp-server (a shell "
        "too), as a stock node does"
    ),
}


# The key exchanges the nodes' sshd offers. OpenSSH 9.0-9.8 (Debian 12 has 9.2) prefers
# sntrup761x25519, whose portable code costs each client about 80 ms of CPU per connection here,
# against 12 ms for curve25519 (OpenSSH 9.9's mlkem768x25519 is as cheap again). A sandbox's
# nodes share this machine's cores, and a mesh's check alone makes 2 N^2 OpenSSH connections;
# paramiko (meshkit's controller) never offers sntrup761. The benchmarks keep OpenSSH's choice:
# their peers' ssh clients pay for it on a stock node.
# Each choice, and the line it writes in the nodes' sshd_config:
#   fast:    curve25519-sha256 only (the sandbox's default);
#   openssh: OpenSSH's own defaults (sntrup761x25519 first on OpenSSH 9.0-9.8), as a stock node.
KEXES = {
    "fast": "KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org\n",
    "openssh": "",
}


def check_name(name: str) -> str:
    if name != DEFAULT and not _NAME.match(name):
        raise SandboxError(
            f"sandbox name {name[:40]!r}: use 1-8 lowercase letters or digits, starting with a "
            "letter (it becomes part of interface names)"
        )
    return name


def default_dir(base: str, name: str) -> str:
    """``base`` for the default sandbox, ``base-NAME`` for the others."""
    return base if name == DEFAULT else f"{base.rstrip('/')}-{name}"


# The subnet ``up`` picks itself: the first /24 of AUTO_CHOICES, from the name's own, that no
# route or address of this machine uses (host_setup.free_subnet), so that two sandboxes never
# share one, whatever their names.
AUTO = "auto"
AUTO_CHOICES = 250  # 10.77.1.0/24 .. 10.77.250.0/24


def auto_choices(name: str) -> list[ipaddress.IPv4Network]:
    """The /24s an automatic subnet is picked from, in order: the one the name hashes to
    first (the same each time while it is free), then the next ones, wrapping around."""
    first = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % AUTO_CHOICES
    choices = []
    for step in range(AUTO_CHOICES):
        third = 1 + (first + step) % AUTO_CHOICES
        choices.append(ipaddress.IPv4Network(f"10.77.{third}.0/24"))
    return choices


def default_subnet(base: str, name: str) -> str:
    """The configured subnet for the default sandbox; AUTO for the others (``up`` picks a /24
    of 10.77.0.0/16 that nothing here uses)."""
    if name == DEFAULT:
        return base
    return AUTO


@dataclass(frozen=True)
class NetworkOptions:
    """Real-world network options (see networks.py), all off by default."""

    second: bool = False
    ifnames: bool = False
    docker: bool = False
    debian_hosts: bool = False

    @classmethod
    def all(cls) -> NetworkOptions:
        return cls(second=True, ifnames=True, docker=True, debian_hosts=True)

    @classmethod
    def parse(cls, text: str) -> NetworkOptions:
        """``--networks`` text: a comma list of option names (``-`` or ``_``), or ``all``."""
        words = []
        for part in text.split(","):
            if part.strip():
                words.append(part.strip().replace("-", "_"))
        if words == ["all"]:
            return cls.all()
        known = {option.name: option.name for option in fields(cls)}
        known["docker0"] = "docker"
        unknown = [word for word in words if word not in known]
        if unknown:
            raise SandboxError(
                f"--networks {text!r}: unknown {', '.join(unknown)}; expected a comma list of "
                "second, ifnames, docker0, debian-hosts, or all"
            )
        return cls(**{known[word]: True for word in words})

    @classmethod
    def from_state(cls, data: object) -> NetworkOptions:
        if not isinstance(data, Mapping):
            return cls()
        return cls(**{option.name: bool(data.get(option.name, False)) for option in fields(cls)})

    def as_state(self) -> dict[str, bool]:
        return asdict(self)

    @property
    def any(self) -> bool:
        return any(asdict(self).values())

    def describe(self) -> str:
        chosen = [name for name, on in asdict(self).items() if on]
        return ", ".join(chosen) or "plain"


@dataclass(frozen=True)
class Node:
    index: int
    name: str
    address: str
    netns: str
    veth: str  # the host end of its veth on the first network


def _numbered(name: str, prefix: str) -> bool:
    return name.startswith(prefix) and name[len(prefix) :].isdigit()


@dataclass(frozen=True)
class Layout:
    root: Path
    subnet: ipaddress.IPv4Network
    count: int
    name: str = DEFAULT
    networks: NetworkOptions = field(default_factory=NetworkOptions)
    bashrc: str = "minimal"  # the nodes' ~/.bashrc: a key of BASHRCS
    user: bool = False  # the sandbox's ordinary user (user.py) on the controller and nodes
    kex: str = "fast"  # the key exchanges the nodes' sshd offers: a key of KEXES

    @property
    def bridge(self) -> str:
        return "mkbr0" if self.name == DEFAULT else f"mkb-{self.name}"

    @property
    def second_bridge(self) -> str:
        return "mkbr1" if self.name == DEFAULT else f"mkc-{self.name}"

    @property
    def netns_prefix(self) -> str:
        return "meshkit-n" if self.name == DEFAULT else f"meshkit-{self.name}-n"

    @property
    def veth_prefix(self) -> str:
        return "mkv" if self.name == DEFAULT else f"mk{self.name}-"

    @property
    def second_veth_prefix(self) -> str:
        # Not a prefix of the first network's ("mkv"/"mk<name>-"), so ownership tests stay exact.
        return "mkw" if self.name == DEFAULT else f"mn{self.name}-"

    def second_veth(self, node: Node) -> str:
        return f"{self.second_veth_prefix}{node.index}"

    def owns_netns(self, netns: str) -> bool:
        return _numbered(netns, self.netns_prefix)

    def owns_veth(self, link: str) -> bool:
        """The host end of a node's veth, on either network."""
        return _numbered(link, self.veth_prefix) or _numbered(link, self.second_veth_prefix)

    @property
    def controller_address(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def nodes(self) -> list[Node]:
        first = self.subnet.network_address + FIRST_HOST
        nodes = []
        for i in range(self.count):
            netns = f"{self.netns_prefix}{i}"
            veth = f"{self.veth_prefix}{i}"
            nodes.append(Node(i, f"node{i}", str(first + i), netns, veth))
        return nodes

    def node(self, index: int) -> Node:
        if not 0 <= index < self.count:
            raise SandboxError(f"node {index}: the sandbox has nodes 0..{self.count - 1}")
        return self.nodes[index]

    def node_dir(self, node: Node) -> Path:
        return self.root / "nodes" / node.name

    @property
    def hostfile(self) -> Path:
        return self.root / "hostfile"

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    @property
    def key(self) -> Path:
        return self.root / "controller" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.root / "controller" / "known_hosts"

    @property
    def shared(self) -> Path:
        """A directory every node sees at the same path: a place for jobs' workdirs."""
        return self.root / "shared"

    @property
    def user_dir(self) -> Path:
        """The sandbox's user's controller files (its own, private): key, known_hosts,
        hostfile and the ssh_config beside it."""
        return self.root / "user"

    @property
    def user_hostfile(self) -> Path:
        return self.user_dir / "hostfile"

    @property
    def user_ssh_config(self) -> Path:
        return self.user_dir / "ssh_config"

    @property
    def user_key(self) -> Path:
        return self.user_dir / "id_ed25519"

    @property
    def user_known_hosts(self) -> Path:
        return self.user_dir / "known_hosts"

    def user_home(self, node: Node) -> Path:
        """The sandbox's user's home on ``node`` (mounted over its home inside the node)."""
        return self.node_dir(node) / "home"

    def sshd_log(self, node: Node) -> Path:
        return self.root / "logs" / f"{node.name}.sshd.log"


def max_nodes(subnet: ipaddress.IPv4Network) -> int:
    """How many nodes fit: addresses from FIRST_HOST up to the one before the broadcast."""
    return min(MAX_NODES, subnet.num_addresses - FIRST_HOST - 1)


def ifnames(sandbox: Layout) -> list[str]:
    """Every interface name the layout creates on the host (bridges, veths)."""
    names = [sandbox.bridge]
    names += [node.veth for node in sandbox.nodes]
    if sandbox.networks.second:
        names.append(sandbox.second_bridge)
        names += [sandbox.second_veth(node) for node in sandbox.nodes]
    return names


def layout(
    root: str | os.PathLike[str],
    subnet: str,
    count: int,
    name: str = DEFAULT,
    networks: NetworkOptions | None = None,
    bashrc: str = "minimal",
    user: bool = False,
    kex: str = "fast",
) -> Layout:
    """The layout, every input checked here rather than by ``ip`` failing mid-up."""
    check_name(name)
    if bashrc not in BASHRCS:
        raise SandboxError(f"--bashrc {bashrc[:40]!r}: expected one of {', '.join(BASHRCS)}")
    if kex not in KEXES:
        raise SandboxError(f"kex {kex[:40]!r}: expected one of {', '.join(KEXES)}")
    if subnet == AUTO:  # up() picks a free one; the name's first choice until then
        subnet = str(auto_choices(name)[0])
    try:
        network = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as exc:
        raise SandboxError(
            f"sandbox subnet {subnet!r}: {exc}; expected e.g. 10.77.0.0/24"
        ) from None
    if not 1 <= count <= MAX_NODES:
        raise SandboxError(f"--nodes {count}: expected 1..{MAX_NODES}")
    if count > max_nodes(network):
        holds = max(0, max_nodes(network))
        raise SandboxError(
            f"subnet {network} is too small for {count} nodes (it holds {holds}); use a /24"
        )
    options = networks or NetworkOptions()
    sandbox = Layout(Path(root).resolve(), network, count, name, options, bashrc, user, kex)
    long = [ifname for ifname in ifnames(sandbox) if len(ifname) > IFNAME_MAX]
    if long:
        raise SandboxError(
            f"interface name {long[0]!r} is longer than {IFNAME_MAX} characters; "
            "use a shorter sandbox name or fewer nodes"
        )
    return sandbox
