"""Where everything of one sandbox lives: pure arithmetic on its name, directory, subnet and size.

Several sandboxes run side by side, each under its own name: its own bridge, namespaces, veths,
subnet and directory. The sandbox named ``default`` keeps the historical names (bridge ``mkbr0``,
namespaces ``meshkit-n<i>``), so a plain ``meshkit sandbox.up`` is what it always was.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SandboxError
from .networks import Options

DEFAULT = "default"
MAX_NODES = 64
FIRST_HOST = 11  # node i is subnet + 11 + i; the controller (bridge) is subnet + 1
# Linux interface names are at most 15 characters: "mk" + name + "-" + two digits must fit.
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


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


def default_subnet(base: str, name: str) -> str:
    """The configured subnet for the default sandbox; a /24 of 10.77.0.0/16 picked from the name
    for the others (an overlap with a route is refused at ``up``, naming ``--subnet``)."""
    if name == DEFAULT:
        return base
    third = 1 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 250
    return f"10.77.{third}.0/24"


@dataclass(frozen=True)
class Node:
    index: int
    name: str
    address: str
    netns: str
    veth: str


@dataclass(frozen=True)
class Layout:
    root: Path
    subnet: ipaddress.IPv4Network
    count: int
    name: str = DEFAULT
    networks: Options = field(default_factory=Options)  # real-world network options (networks.py)

    @property
    def bridge(self) -> str:
        return "mkbr0" if self.name == DEFAULT else f"mkb-{self.name}"

    @property
    def netns_prefix(self) -> str:
        return "meshkit-n" if self.name == DEFAULT else f"meshkit-{self.name}-n"

    @property
    def veth_prefix(self) -> str:
        return "mkv" if self.name == DEFAULT else f"mk{self.name}-"

    def owns_netns(self, netns: str) -> bool:
        rest = netns[len(self.netns_prefix) :]
        return netns.startswith(self.netns_prefix) and rest.isdigit()

    def owns_veth(self, link: str) -> bool:
        rest = link[len(self.veth_prefix) :]
        return link.startswith(self.veth_prefix) and rest.isdigit()

    @property
    def controller_address(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def nodes(self) -> list[Node]:
        return [
            Node(
                i,
                f"node{i}",
                str(self.subnet.network_address + FIRST_HOST + i),
                f"{self.netns_prefix}{i}",
                f"{self.veth_prefix}{i}",
            )
            for i in range(self.count)
        ]

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

    def sshd_log(self, node: Node) -> Path:
        return self.root / "logs" / f"{node.name}.sshd.log"


def layout(
    root: str | os.PathLike[str],
    subnet: str,
    count: int,
    name: str = DEFAULT,
    networks: Options | None = None,
) -> Layout:
    check_name(name)
    try:
        net = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as exc:
        raise SandboxError(
            f"sandbox subnet {subnet!r}: {exc}; expected e.g. 10.77.0.0/24"
        ) from None
    if not 1 <= count <= MAX_NODES:
        raise SandboxError(f"--nodes {count}: expected 1..{MAX_NODES}")
    if net.num_addresses < FIRST_HOST + count + 1:
        raise SandboxError(f"subnet {net} is too small for {count} nodes; use a /24")
    return Layout(Path(root).resolve(), net, count, name, networks or Options())
