"""mesh, check and unmesh over every node: one connection (one login) and one node shell per node,
and the reports of what was done.

inspect (read only; host keys proven by sshd in the connection) -> plan (pure, meshkit.meshplan)
-> keys (create or derive missing user keys) -> install (under the node's ~/.ssh flock: re-read,
re-merge if changed, atomic rename) -> verify (N x N from the nodes themselves). Nothing is
written anywhere unless every node passed inspection (or --skip-unreachable leaves the failed
ones out) and no name conflicts. What each phase does on one node is ``mesh_node``'s; the N x N
check is ``verify``'s. Functions return dataclasses and print nothing; domain errors are raised
for the CLI to report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import meshplan as mp
from ..errors import MeshAbort, MeshkitError
from ..hostfile import Host
from ..meshplan import NodeFacts, UnmeshPlan, UserKey
from ..outcome import ProgressFn, failed, succeeded
from ..record import replace
from ..remote.connection import Remote, Settings
from ..remote.group import SshGroup
from ..remote.node_shell import NodeShell
from ..verifyplan import VerifyResult
from .mesh_node import (
    INSPECT,
    NodeReport,
    apply_unmesh,
    inspect,
    install,
    make_user_key,
    node_report,
)
from .verify import verify


@dataclass
class MeshReport:
    hosts: list[Host]
    mesh_id: str
    dry_run: bool
    nodes: list[NodeReport] = field(default_factory=list)
    left_out: dict[Host, str] = field(default_factory=dict)
    names: dict[Host, list[tuple[str, str]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    verify: VerifyResult | None = None
    host_keys_by: dict[Host, str] = field(default_factory=dict)  # how each node's were proven

    @property
    def failed(self) -> list[NodeReport]:
        return [node for node in self.nodes if node.result == "failed"]

    @property
    def ok(self) -> bool:
        if self.failed or self.left_out:
            return False
        return not (self.verify and self.verify.failures)


class Shells:
    """Each node's one shell for this run, started as its connection opens (SshGroup's
    ``on_open``, in the connecting worker) with inspect's first round already sent, so the
    user's shell start-up (its ~/.bashrc) overlaps the other nodes' connects."""

    def __init__(self) -> None:
        self.shells: dict[Host, NodeShell] = {}
        self.errors: dict[Host, Exception] = {}

    def start(self, remote: Remote) -> None:
        try:
            self.shells[remote.host] = NodeShell(remote, *INSPECT)
        except Exception as exc:  # on_open must not raise: inspect reports it for this node
            self.errors[remote.host] = exc

    def inspect(self, remote: Remote) -> NodeFacts:
        if remote.host in self.errors:
            raise self.errors[remote.host]
        return inspect(remote, self.shells[remote.host])


def _inspect_all(
    group: SshGroup, shells: Shells, what: str, skip: bool = False
) -> tuple[dict[Host, NodeFacts], dict[Host, str]]:
    """Every node's facts and the nodes that failed (connect or inspect); with any failure and
    not ``skip``, stop before anything is written."""
    inspected = group.each("inspect", shells.inspect)
    failures = {**group.failures, **failed(inspected)}
    if failures and not skip:
        lines = [f"{what}: {len(failures)} node(s) failed, so no node was changed:"]
        lines += [f"  {host.label}: {error}" for host, error in failures.items()]
        lines.append("  fix them, or rerun with --skip-unreachable to leave them out")
        raise MeshAbort(lines)
    return succeeded(inspected), failures  # in the hostfile's order, as ``each`` keeps it


def _with_placeholder(facts: NodeFacts) -> NodeFacts:
    """The node's facts with a placeholder for a user key still to be made (a dry run shows it;
    it is never written)."""
    if facts.user.key:
        return facts
    placeholder = replace(facts.user, key=mp.placeholder_key(facts.host))
    return replace(facts, user=placeholder)


def mesh(
    hosts: Sequence[Host],
    settings: Settings,
    mesh_id: str,
    *,
    skip_unreachable: bool = False,
    dry_run: bool = False,
    check: bool = True,
    progress: ProgressFn | None = None,
) -> MeshReport:
    """Passwordless SSH among ``hosts`` with strict host keys, in one login per node."""
    if dry_run:
        settings = replace(settings, record_new_host_keys=False)
    report = MeshReport(list(hosts), mesh_id, dry_run)
    shells = Shells()
    with SshGroup(hosts, settings, progress=progress, on_open=shells.start) as group:
        by_host, report.left_out = _inspect_all(group, shells, "mesh", skip_unreachable)
        facts = list(by_host.values())
        if not facts:
            raise MeshAbort("mesh: no node is reachable")
        names = {fact.host: fact.names for fact in facts}
        report.names, report.notes = mp.drop_shared_addresses(names)
        for fact in facts:
            fact.names = tuple(report.names[fact.host])
        report.host_keys_by = {fact.host: fact.host_keys_by for fact in facts}
        # Conflicts between names are known before any key is made: stop before writing. Keys
        # still to be made stand in as placeholders (shown by a dry run, never written).
        shown = [_with_placeholder(fact) for fact in facts]
        plans = mp.plan(shown, mesh_id)
        stop = mp.conflicts(shown, plans)
        if stop:
            tense = "would be" if dry_run else "was"
            raise MeshkitError([*stop, f"mesh: conflicts; nothing {tense} written"])
        if dry_run:
            report.nodes = [node_report(fact, plans[fact.host], True) for fact in facts]
            return report
        todo = {fact.host: fact.user for fact in facts if fact.user.action != "kept"}

        def make_key(remote: Remote) -> UserKey:
            return make_user_key(remote, shells.shells[remote.host], todo[remote.host])

        made = group.each("keys", make_key, list(todo))
        bad = failed(made)
        if bad:
            raise MeshkitError(
                [f"  {host.label}: {error}" for host, error in bad.items()]
                + ["mesh: user keys failed; authorized_keys and known_hosts were not changed"]
            )
        made_keys = succeeded(made)
        for fact in facts:
            fact.user = made_keys.get(fact.host, fact.user)
        # With every key made, no conflict can be new: known_hosts conflicts are host keys' only.
        plans = mp.plan(facts, mesh_id)
        wanted = mp.entries(facts, mesh_id)

        def write(remote: Remote) -> NodeReport:
            host = remote.host
            return install(shells.shells[host], by_host[host], plans[host], wanted)

        changing = [fact.host for fact in facts if plans[fact.host].changes]
        written = group.each("install", write, changing)
        for fact in facts:
            outcome = written.get(fact.host)
            if outcome is not None and outcome.value is not None:
                node = outcome.value
            else:
                node = node_report(fact, plans[fact.host], False)
            if outcome is not None and outcome.error is not None:
                node.result = "failed"
                node.error = outcome.error
            report.nodes.append(node)
        if check and not report.failed:
            own = {fact.host: fact.hostname for fact in facts}
            report.verify = verify(group, list(by_host), own, shells.shells)
    return report


def check(
    hosts: Sequence[Host], settings: Settings, progress: ProgressFn | None = None
) -> VerifyResult:
    """``verify`` over connections of its own (``meshkit check``)."""
    with SshGroup(hosts, settings, progress=progress) as group:
        return verify(group, hosts)


@dataclass
class UnmeshNode:
    host: Host
    plan: UnmeshPlan
    result: str = "unchanged"  # removed | unchanged | failed (or "would change")
    error: str | None = None


@dataclass
class UnmeshReport:
    mesh_id: str
    dry_run: bool
    nodes: list[UnmeshNode] = field(default_factory=list)

    @property
    def failed(self) -> list[UnmeshNode]:
        return [node for node in self.nodes if node.result == "failed"]


def unmesh(
    hosts: Sequence[Host],
    settings: Settings,
    mesh_id: str,
    *,
    keep_keys: bool = False,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
) -> UnmeshReport:
    """Take this mesh's lines off every node (lines other meshes also list stay, with their tag),
    delete the keys it generated that no other mesh lists, clean stale temp files."""
    if dry_run:
        settings = replace(settings, record_new_host_keys=False)
    report = UnmeshReport(mesh_id, dry_run)
    shells = Shells()
    with SshGroup(hosts, settings, progress=progress, on_open=shells.start) as group:
        facts, _ = _inspect_all(group, shells, "unmesh")
        changes = {host: mp.plan_unmesh(fact, mesh_id, keep_keys) for host, fact in facts.items()}

        def remove(remote: Remote) -> UnmeshPlan:
            host = remote.host
            return apply_unmesh(shells.shells[host], changes[host], facts[host], mesh_id)

        todo = [host for host in hosts if changes[host].changes and not dry_run]
        done = group.each("remove", remove, todo)
        changed = "would change" if dry_run else "removed"
        for host in hosts:
            outcome = done.get(host)
            plan = changes[host]
            if outcome is not None and outcome.value is not None:
                plan = outcome.value  # as written: taken off again if the files changed
            node = UnmeshNode(host, plan, changed if changes[host].changes else "unchanged")
            if outcome is not None and outcome.error is not None:
                node.result = "failed"
                node.error = outcome.error
            report.nodes.append(node)
    return report
