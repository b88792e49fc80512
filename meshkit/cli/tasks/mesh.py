"""``mesh``, ``check`` and ``unmesh`` tasks: flags in, meshkit.ops.mesh, tables out."""

from __future__ import annotations

import json as jsonlib
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import MeshkitError
from ...hostfile import Host
from ...settings import pick

if TYPE_CHECKING:
    from ...keys import Merge
    from ...ops.mesh import MeshReport
    from ...verifyplan import VerifyResult

from ..common import conf, helps, progress, reported, table, task
from ..printing import say

HOST_FLAGS = ("hostfile", "include", "exclude")
SHOWN_FAILURES = 50  # pairs listed under the matrix; the matrix shows them all
SHOWN_LINE = 110  # characters of a line a dry run would add
SSH_HELP = {
    "identity": (
        "private key the controller logs in with (a bootstrap key; default: ssh config/agent)"
    ),
    "password": "prompt once for a login password and use it for every node",
    "accept_new_host_keys": (
        "trust host keys seen for the first time (recorded in ~/.ssh/known_hosts)"
    ),
}


def _hosts(
    hostfile: str | None, include: str | None, exclude: str | None
) -> tuple[list[Host], str]:
    from ...discovery import read_hosts

    config = conf()  # a flag when given, else the configured value
    path = str(pick(config, "hostfile", hostfile))
    included = pick(config, "include", include)
    excluded = pick(config, "exclude", exclude)
    return read_hosts(path, included, excluded, spares=True), path


def _mesh_id(hostfile: str | None) -> str:
    """The mesh's id, from every node of the hostfile (--include/--exclude do not change it)."""
    from ...meshplan import mesh_id

    hosts, _ = _hosts(hostfile, None, None)
    return mesh_id(hosts)


def _verify_report(result: VerifyResult) -> int:
    from ...verifyplan import matrix

    hosts = result.hosts
    failures = result.failures
    pairs = len(hosts) ** 2
    say(
        f"verify: {result.ok_pairs}/{pairs} pairs log in by hostfile name (BatchMode, "
        "StrictHostKeyChecking=yes) and pass the host-key check by hostname (key exchange only, "
        "PreferredAuthentications=none)"
    )
    if failures:
        say(matrix(hosts, failures))
        for failure in failures[:SHOWN_FAILURES]:
            say(f"  {failure.source.label} -> {failure.target.label}: {failure.error}")
    return len(failures)


@task(
    help=helps(
        *HOST_FLAGS,
        **SSH_HELP,
        skip_unreachable=(
            "mesh the reachable nodes and list the others, instead of changing nothing"
        ),
        dry_run="connect and show what would change on each node; change nothing anywhere",
        verify="check every pair afterwards from the nodes themselves (default on; --no-verify)",
    )
)
def mesh(
    c: Context,
    hostfile: str | None = None,
    identity: str | None = None,
    password: bool = False,
    accept_new_host_keys: bool = False,
    skip_unreachable: bool = False,
    dry_run: bool = False,
    verify: bool = True,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Passwordless SSH among all hostfile nodes, with strict host keys, in one login per node.

    Collects each node's user key (creating ed25519 if none) and the host keys its sshd proves it
    serves, installs every key in every authorized_keys and every host key in every known_hosts
    under every name the node answers to (tagged with this mesh, merged under a lock, atomic),
    then checks all N x N pairs. Rerunning changes nothing; `meshkit unmesh` undoes it.
    """
    from ...ops import mesh as ops
    from ...ops.pool import ssh_settings

    with reported():
        hosts, path = _hosts(hostfile, include, exclude)
        settings = ssh_settings(conf(), path, identity, password, accept_new_host_keys)
        dry = " (dry run)" if dry_run else ""
        say(f"mesh: {len(hosts)} nodes from {path}{dry}")
        report = ops.mesh(
            hosts,
            settings,
            _mesh_id(hostfile),
            skip_unreachable=skip_unreachable,
            dry_run=dry_run,
            check=verify,
            progress=progress,
        )
        _show(report)
        if report.failed:
            fix = "mesh: some nodes were not changed (above); rerun mesh once they are fixed"
            failures = [f"  {node.host.label}: {node.error}" for node in report.failed]
            raise MeshkitError([*failures, fix])
        if report.verify and _verify_report(report.verify):
            raise Exit("meshkit: mesh installed, but some pairs cannot log in (see above)", 1)
        if report.left_out:
            left = ", ".join(host.label for host in report.left_out)
            raise Exit(f"meshkit: meshed {len(report.nodes)} nodes; left out: {left}", 1)


def _added(merge: Merge) -> str:
    """``+added ~shared``: lines this mesh adds, and lines it shares with another mesh."""
    shared = f" ~{merge.claimed}" if merge.claimed else ""
    return f"+{len(merge.added)}{shared}"


def _show(report: MeshReport) -> None:
    rows = []
    for node in report.nodes:
        authorized = _added(node.plan.authorized)
        known = _added(node.plan.known)
        index = report.hosts.index(node.host)
        rows.append((index, node.host.label, node.user_key, authorized, known, node.result))
    say(table(["#", "node", "user key", "authorized_keys", "known_hosts", "result"], rows))
    shared = "~N: lines shared with another mesh"
    say(f"  mesh id {report.mesh_id} (tagged on every line it adds; {shared})")
    for note in report.notes:
        say(f"  note: {note}")
    nodes_by_how: dict[str, list[str]] = {}
    for host, how in report.host_keys_by.items():
        nodes_by_how.setdefault(how, []).append(host.label)
    for how, labels in nodes_by_how.items():
        say(f"  host keys {how}: {', '.join(labels)}")
    for host, names in report.names.items():
        spelled = ", ".join(f"{name} ({why})" for name, why in names)
        say(f"  {host.label} answers to: {spelled}")
    for node in report.nodes:
        label = node.host.label
        for note in node.notes:
            say(f"  {label}: note: {note}")
        if node.cleaned:
            say(f"  {label}: removed {node.cleaned} stale meshkit temp file(s)")
        if report.dry_run:
            for line in node.plan.authorized.added + node.plan.known.added:
                say(f"  {label}: would add: {line[:SHOWN_LINE]}")
    for host, error in report.left_out.items():
        say(f"  {host.label}: left out: {error}")


@task(help=helps(*HOST_FLAGS, "json", identity=SSH_HELP["identity"]))
def check(
    c: Context,
    hostfile: str | None = None,
    json: bool = False,
    identity: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Check all N x N pairs: from every node, ssh to every node by the hostfile spelling with
    BatchMode and strict host keys, and check each node's host key by its hostname."""
    from ...ops import mesh as ops
    from ...ops.pool import ssh_settings

    with reported():
        hosts, path = _hosts(hostfile, include, exclude)
        result = ops.check(hosts, ssh_settings(conf(), path, identity), progress=progress)
        if not json:
            if _verify_report(result):
                raise Exit("meshkit: check failed; run `meshkit mesh` to fix", 1)
            return
    failures = [
        {"from": failure.source.label, "to": failure.target.label, "error": failure.error}
        for failure in result.failures
    ]
    nodes = [host.label for host in hosts]
    print(jsonlib.dumps({"nodes": nodes, "ok": not result.failures, "failures": failures}))
    if result.failures:
        raise Exit(code=1)


@task(
    help=helps(
        *HOST_FLAGS,
        identity=SSH_HELP["identity"],
        keep_keys=(
            "keep user keys that mesh created (default: remove them, unless another mesh uses them)"
        ),
        dry_run="show what would be removed; change nothing",
    )
)
def unmesh(
    c: Context,
    hostfile: str | None = None,
    identity: str | None = None,
    keep_keys: bool = False,
    dry_run: bool = False,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Remove exactly what this hostfile's mesh added: its tagged authorized_keys and known_hosts
    lines (lines another mesh also relies on stay) and the user keys it created that no other mesh
    lists. Every other line stays byte for byte."""
    from ...ops import mesh as ops
    from ...ops.pool import ssh_settings

    with reported():
        hosts, path = _hosts(hostfile, include, exclude)
        settings = ssh_settings(conf(), path, identity)
        report = ops.unmesh(
            hosts,
            settings,
            _mesh_id(hostfile),
            keep_keys=keep_keys,
            dry_run=dry_run,
            progress=progress,
        )
        rows: list[tuple[str, ...]] = []
        for node in report.nodes:
            plan = node.plan
            authorized = f"-{plan.authorized_removed}"
            known = f"-{plan.known_removed}"
            rows.append((node.host.label, authorized, known, plan.remove_key or "-", node.result))
        key = "would remove key" if dry_run else "key removed"
        say(table(["node", "authorized_keys", "known_hosts", key, "result"], rows))
        for node in report.nodes:
            if node.plan.kept_key:
                say(f"  {node.host.label}: {node.plan.kept_key}")
        if report.failed:
            raise MeshkitError([f"  {node.host.label}: {node.error}" for node in report.failed])
