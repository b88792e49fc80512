"""``mesh``, ``check`` and ``unmesh`` tasks: flags in, phases of meshkit.mesh, tables out."""

from __future__ import annotations

import getpass
import json as jsonlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import MeshAbort, MeshkitError
from ...hostfile import Host
from ..common import conf, helps, option, progress, reported, table, task

SSH_HELP = {
    "identity": "private key the controller logs in with (a bootstrap key; default: ssh config/agent)",
    "password": "prompt once for a login password and use it for every node",
    "accept_new_host_keys": "trust host keys seen for the first time (recorded in ~/.ssh/known_hosts)",
}


def _hosts(
    c: Context, hostfile: str | None, include: str | None, exclude: str | None
) -> tuple[list[Host], str]:
    from ...discovery import read_hosts

    path = option("hostfile", hostfile)
    return read_hosts(path, option("include", include), option("exclude", exclude)), str(path)


def ssh_settings(
    c: Context,
    hostfile: str,
    identity: str | None = None,
    password: bool = False,
    accept_new: bool = False,
) -> Any:
    """Connection settings from config and flags; the ssh_config beside the hostfile is read too."""
    from ...remote import Settings

    cfg = conf()
    configs = [
        str(p)
        for p in (cfg.ssh_config, Path(hostfile).parent / "ssh_config")
        if p and Path(p).is_file()
    ]
    secret = getpass.getpass("SSH password for all nodes: ") if password else None
    return Settings(
        connect_timeout=float(cfg.connect_timeout),
        command_timeout=float(cfg.command_timeout),
        identity=identity or cfg.identity,
        password=secret,
        accept_new=accept_new,
        ssh_configs=tuple(configs),
        user=cfg.user,
        port=int(cfg.port) if cfg.port else None,
        parallel=int(cfg.parallel),
    )


def _abort(failures: dict[Host, str], what: str) -> MeshAbort:
    lines = [f"{what}: {len(failures)} node(s) failed, so no node was changed:"]
    lines += [f"  {h.label}: {err}" for h, err in failures.items()]
    lines.append("  fix them, or rerun with --skip-unreachable to leave them out")
    return MeshAbort(lines)


def _verify_report(cluster: Any, hosts: Sequence[Host]) -> int:
    from ...mesh import matrix, verify

    failures = verify(cluster, hosts)
    pairs = len(hosts) ** 2
    print(
        f"verify: {pairs - len({(f.source, f.target) for f in failures})}/{pairs} pairs log in "
        "(BatchMode, StrictHostKeyChecking=yes)"
    )
    if failures:
        print(matrix(hosts, failures))
        for f in failures[:50]:
            print(f"  {f.source.label} -> {f.target.label}: {f.error}")
    return len(failures)


@task(
    help=helps(
        "hostfile",
        "include",
        "exclude",
        **SSH_HELP,
        skip_unreachable="mesh the reachable nodes and list the others, instead of changing nothing",
        dry_run="connect and show what would change on each node; change nothing",
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

    Collects each node's user key (creating ed25519 if none) and host keys, installs every key in
    every authorized_keys and every host key in every known_hosts (tagged, merged, atomic), then
    checks all N x N pairs. Rerunning changes nothing; `meshkit unmesh` undoes it.
    """
    from ... import mesh as m
    from ...localnet import resolve_all
    from ...remote import Cluster, failed, succeeded

    with reported():
        hosts, path = _hosts(c, hostfile, include, exclude)
        addresses = resolve_all(h.host for h in hosts)
        st = ssh_settings(c, path, identity, password, accept_new_host_keys)
        print(f"mesh: {len(hosts)} nodes from {path}{' (dry run)' if dry_run else ''}")
        with Cluster(hosts, st, progress=progress) as cluster:
            inspected = cluster.each("inspect", m.inspect)
            failures = {**cluster.failures, **failed(inspected)}
            if failures and not skip_unreachable:
                raise _abort(failures, "mesh")
            live = [h for h in hosts if h not in failures]
            if not live:
                raise MeshAbort("mesh: no node is reachable")
            facts = list(succeeded(inspected).values())
            if dry_run:
                plans = m.plan(_with_placeholders(facts), addresses)
                for f in facts:
                    plans[f.host].generate_key = f.inspection.user_key is None
                _show_plan(live, plans, failures)
                return
            made = cluster.each(
                "keys", m.generate_key, [f.host for f in facts if f.inspection.user_key is None]
            )
            bad = failed(made)
            if bad:
                raise MeshkitError(
                    [f"  {h.label}: {e}" for h, e in bad.items()]
                    + [
                        "mesh: creating user keys failed; authorized_keys and known_hosts were not changed"
                    ]
                )
            for f in facts:
                f.inspection = succeeded(made).get(f.host, f.inspection)
            plans = m.plan(facts, addresses)
            for h in made:
                plans[h].generate_key = True
            conflicts = [line for p in plans.values() for line in p.conflicts]
            if conflicts:
                raise MeshkitError([*conflicts, "mesh: known_hosts conflicts; nothing was written"])
            written = cluster.each("install", lambda r: m.install(r, plans[r.host]), live)
            bad = failed(written)
            _show_plan(live, plans, failures, done=True)
            if bad:
                raise MeshkitError([f"  {h.label}: install failed: {e}" for h, e in bad.items()])
            if verify and _verify_report(cluster, live):
                raise Exit("meshkit: mesh installed, but some pairs cannot log in (see above)", 1)
        if failures:
            raise Exit(
                f"meshkit: meshed {len(live)} nodes; left out: {', '.join(h.label for h in failures)}",
                1,
            )


def _with_placeholders(facts: list[Any]) -> list[Any]:
    from dataclasses import replace

    from ...mesh import placeholder_key

    return [
        f
        if f.inspection.user_key
        else replace(f, inspection=replace(f.inspection, user_key=placeholder_key(f.host)))
        for f in facts
    ]


def _show_plan(
    hosts: Sequence[Host], plans: dict[Host, Any], failures: dict[Host, str], done: bool = False
) -> None:
    verb = "" if done else "would "
    rows = []
    for i, h in enumerate(hosts):
        p = plans[h]
        rows.append(
            (
                i,
                h.label,
                "created" if p.generate_key and done else "create" if p.generate_key else "kept",
                f"+{len(p.authorized_added)}",
                f"+{len(p.known_added)}",
                "changed" if p.changes else "unchanged",
            )
        )
    print(table(["#", "node", "user key", "authorized_keys", "known_hosts", "result"], rows))
    if not done:
        for h in hosts:
            for line in plans[h].authorized_added + plans[h].known_added:
                print(f"  {h.label}: {verb}add: {line[:110]}")
    for h, err in failures.items():
        print(f"  {h.label}: left out: {err}")


@task(help=helps("hostfile", "include", "exclude", "json", identity=SSH_HELP["identity"]))
def check(
    c: Context,
    hostfile: str | None = None,
    json: bool = False,
    identity: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Check all N x N pairs: from every node, ssh to every node with BatchMode and strict host keys."""
    from ...mesh import verify
    from ...remote import Cluster

    with reported():
        hosts, path = _hosts(c, hostfile, include, exclude)
        with Cluster(hosts, ssh_settings(c, path, identity), progress=progress) as cluster:
            if not json:
                failed = _verify_report(cluster, hosts)
                if failed:
                    raise Exit("meshkit: check failed; run `meshkit mesh` to fix", 1)
                return
            failures = verify(cluster, hosts)
    print(
        jsonlib.dumps(
            {
                "nodes": [h.label for h in hosts],
                "ok": not failures,
                "failures": [
                    {"from": f.source.label, "to": f.target.label, "error": f.error}
                    for f in failures
                ],
            }
        )
    )
    if failures:
        raise Exit(code=1)


@task(
    help=helps(
        "hostfile",
        "include",
        "exclude",
        identity=SSH_HELP["identity"],
        keep_keys="keep user keys that mesh created (default: remove them too)",
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
    """Remove exactly what mesh added: its tagged authorized_keys and known_hosts lines and the user
    keys it created. Every other line stays byte for byte."""
    from ... import mesh as m
    from ...remote import Cluster, failed, succeeded

    with reported():
        hosts, path = _hosts(c, hostfile, include, exclude)
        with Cluster(hosts, ssh_settings(c, path, identity), progress=progress) as cluster:
            inspected = cluster.each("inspect", m.inspect)
            failures = {**cluster.failures, **failed(inspected)}
            if failures:
                raise _abort(failures, "unmesh")
            changes = {h: m.plan_unmesh(f, keep_keys) for h, f in succeeded(inspected).items()}
            rows = [
                (h.label, f"-{ch.authorized_removed}", f"-{ch.known_removed}", ch.remove_key or "-")
                for h, ch in changes.items()
            ]
            if not dry_run:
                bad = failed(cluster.each("remove", lambda r: m.apply_unmesh(r, changes[r.host])))
                if bad:
                    raise MeshkitError([f"  {h.label}: {e}" for h, e in bad.items()])
        print(
            table(
                [
                    "node",
                    "authorized_keys",
                    "known_hosts",
                    "key removed" if not dry_run else "would remove key",
                ],
                rows,
            )
        )
