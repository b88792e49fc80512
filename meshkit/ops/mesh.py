"""mesh, check and unmesh over the nodes: phases over one connection (one login) per node.

inspect (read only, SFTP) -> plan (pure, meshkit.meshplan) -> keys (create or derive missing user
keys) -> install (under the node's ~/.ssh flock: re-read, re-merge if changed, atomic rename) ->
verify (N x N from the nodes themselves). Nothing is written anywhere unless every node passed
inspection (or --skip-unreachable leaves the failed ones out) and no name conflicts. Functions
return dataclasses and print nothing; domain errors are raised for the CLI to report.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import keys
from ..errors import KeyFormatError, MeshAbort, MeshkitError, RemoteError, UnsafeFileError
from ..hostfile import Host
from ..keys import PublicKey
from ..meshplan import (
    AUTHORIZED,
    KNOWN,
    USER_KEY_SLOTS,
    Entries,
    FileStat,
    KeySlot,
    NodeFacts,
    NodePlan,
    PairFailure,
    UnmeshPlan,
    UserKey,
    VerifyResult,
    authorized_keys_problem,
    choose_user_key,
    conflicts,
    drop_shared_addresses,
    entries,
    hostnames,
    is_meshkit_temp,
    keygen_command,
    node_names,
    parse_fib_trie,
    parse_if_inet6,
    parse_verify,
    placeholder_key,
    plan,
    plan_unmesh,
    sshd_directives,
    unmesh_texts,
    unsafe_files,
    verify_script,
)
from ..record import replace
from ..remote import Cluster, Remote, Settings, failed, succeeded
from ..remote.group import ProgressFn
from ..remote.hostkeys import proven_host_keys

WRITE_ATTEMPTS = 4  # re-merges when someone changes a file while we write; then give up
SSHD_CONFIG = "/etc/ssh/sshd_config"


# ---------------------------------------------------------------- inspect


def _safe_read(remote: Remote, path: str, limit: int = 256 << 10) -> str:
    """A system file that may be unreadable or absent on some nodes: '' then."""
    try:
        return remote.read_text(path, limit) or ""
    except (PermissionError, MeshkitError):
        return ""
    except OSError:
        return ""


def _check_files(remote: Remote) -> None:
    """Refuse (never repair) a ~/.ssh that sshd's StrictModes would refuse, and symlinks."""
    label = remote.host.label
    home = remote.home()
    home_stat = FileStat.of(home, *remote.lstat("."))
    # ~/.ssh itself may be a link (to a shared home): judge what it points at.
    try:
        st = remote.sftp.stat(".ssh")
        ssh_stat = FileStat.of("~/.ssh", st.st_mode, st.st_uid)
    except FileNotFoundError:
        ssh_stat = FileStat("~/.ssh", "missing")
    found = [ssh_stat]
    if ssh_stat.kind == "dir":
        found += [FileStat.of("~/" + p, *remote.lstat(p)) for p in (AUTHORIZED, KNOWN)]
    problems = unsafe_files(label, home_stat, found)
    if problems:
        raise UnsafeFileError(problems)
    # sshd must read ~/.ssh/authorized_keys, or the keys mesh installs are never used.
    value, where = _authorized_keys_file(remote, SSHD_CONFIG, 0)
    problem = authorized_keys_problem(label, value, where, home)
    if problem:
        raise RemoteError(problem)


def _authorized_keys_file(remote: Remote, path: str, depth: int) -> tuple[str | None, str]:
    """sshd's first AuthorizedKeysFile (Include files followed in place, as sshd reads them)."""
    text = _safe_read(remote, path)
    for word, args in sshd_directives(text):
        if word == "authorizedkeysfile":
            return args, path
        if word == "include" and depth < 4:
            for pattern in args.split():
                full = pattern if pattern.startswith("/") else f"/etc/ssh/{pattern}"
                folder, _, glob = full.rpartition("/")
                for name in sorted(remote.listdir(folder or "/")):
                    if fnmatch.fnmatch(name, glob):
                        value, where = _authorized_keys_file(remote, f"{folder}/{name}", depth + 1)
                        if value is not None:
                            return value, where
    return None, path


def _user_key(remote: Remote) -> UserKey:
    slots = [
        KeySlot(path, remote.exists(path), remote.read_text(path + ".pub", 64 << 10))
        for path in USER_KEY_SLOTS
    ]
    return choose_user_key(slots, remote.host.label)


def _claimed_host_keys(remote: Remote) -> tuple[list[PublicKey], list[str]]:
    found, notes = [], []
    for name in sorted(remote.listdir("/etc/ssh")):
        if name.startswith("ssh_host_") and name.endswith("_key.pub"):
            text = _safe_read(remote, f"/etc/ssh/{name}", 64 << 10).strip()
            try:
                found.append(keys.parse_public_key(text, f"/etc/ssh/{name}"))
            except KeyFormatError as exc:
                notes.append(str(exc))
    return found, notes


def own_hostname(remote: Remote) -> str:
    return _safe_read(remote, "/proc/sys/kernel/hostname", 4096).strip()


def _names(remote: Remote, hostname: str) -> list[tuple[str, str]]:
    """Gathered on the node over the same connection: its hostnames and every usable address of
    its network namespace (what ``hostname``, ``hostname -f`` and ``ip addr`` would say)."""
    host, port = remote.address
    connected = [(host, "ssh_config HostName")]
    peer = remote.peer
    if peer:
        connected.append((peer, "connected address"))
    own = hostnames(
        hostname,
        _safe_read(remote, "/etc/hosts"),
        _safe_read(remote, "/proc/sys/kernel/domainname"),
    )
    addresses = parse_fib_trie(_safe_read(remote, "/proc/net/fib_trie", 4 << 20))
    addresses += parse_if_inet6(_safe_read(remote, "/proc/net/if_inet6"))
    return node_names(remote.host, port, connected, own, addresses)


def inspect(remote: Remote) -> NodeFacts:
    """Read only, over SFTP alone (no remote shell): refuses unsafe files; finds the user key, the
    host keys sshd proves it serves, every name the node answers to, the two files, stale temps."""
    with remote.bounded("inspect"):
        _check_files(remote)
        user = _user_key(remote)
        claimed, notes = _claimed_host_keys(remote)
        host_keys, unproven = proven_host_keys(remote, claimed)
        hostname = own_hostname(remote)
        return NodeFacts(
            host=remote.host,
            user=user,
            host_keys=tuple(host_keys),
            names=tuple(_names(remote, hostname)),
            authorized=remote.read_text(AUTHORIZED),
            known=remote.read_text(KNOWN),
            hostname=hostname,
            stale=tuple(n for n in remote.listdir(".ssh") if is_meshkit_temp(n)),
            notes=tuple(notes + unproven),
        )


# ---------------------------------------------------------------- keys and install


def make_user_key(remote: Remote, user: UserKey) -> UserKey:
    """Create (ssh-keygen) or derive (ssh-keygen -y) the node's user key; never overwrites."""
    with remote.bounded("keys"):
        code, out, err = remote.run(keygen_command(user, remote.host.label))
    if code != 0:
        verb = "deriving the public half of" if user.action == "derive" else "creating"
        raise KeyFormatError(
            f"{verb} ~/{user.path} failed (exit {code}): {err.strip()[:200]}"
            + (
                "; is the key protected by a passphrase? write its .pub yourself"
                if user.action == "derive"
                else ""
            )
        )
    line = out.strip().splitlines()[0] if out.strip() else ""
    return replace(user, key=keys.parse_public_key(line, f"{remote.host.label}: ~/{user.path}.pub"))


@dataclass
class Written:
    """What install did on one node: the merges it wrote, and the stale temps it removed."""

    plan: NodePlan
    cleaned: int = 0
    remerged: bool = False


def _clean_stale(remote: Remote) -> int:
    """Under the lock no meshkit write is in progress: every meshkit temp file is stale."""
    stale = [n for n in remote.listdir(".ssh") if is_meshkit_temp(n)]
    for name in stale:
        remote.remove(f".ssh/{name}")
    return len(stale)


def _put(
    remote: Remote, base: tuple[str | None, str | None], new: tuple[str | None, str | None]
) -> bool:
    """Write the files of ``new`` that differ from ``base``; right before the renames, re-read both
    and compare with ``base``: False (nothing renamed) when someone changed them meanwhile. A new
    text of None or '' for a file that mesh emptied removes it."""
    temps: list[tuple[str, str | None]] = []
    try:
        for path, old, text in zip((AUTHORIZED, KNOWN), base, new):
            if text is not None and text != (old or ""):
                temps.append((path, remote.write_temp(path, text) if text.strip() else None))
        if not temps:
            return True
        now = (remote.read_text(AUTHORIZED), remote.read_text(KNOWN))
        if now != base:
            return False
        for path, tmp in temps:
            if tmp is None:
                remote.remove(path)  # it held only what meshkit added
            else:
                remote.rename(tmp, path)
        temps = []
        return True
    finally:
        for _, tmp in temps:
            if tmp is not None:
                remote.discard(tmp)


def install(remote: Remote, fact: NodeFacts, planned: NodePlan, wanted: Entries) -> Written:
    """Under the node's ~/.ssh flock: clean stale temps, re-read both files and re-merge if they
    changed since inspect, write temps, compare once more right before the renames (re-merging
    again if a writer that ignores the lock got in between). Bounded by command_timeout."""
    with remote.bounded("install"):
        remote.ensure_dir(".ssh", 0o700)
        with remote.locked(".ssh"):
            cleaned = _clean_stale(remote)
            _check_files(remote)
            base = (fact.authorized, fact.known)
            current = planned
            for attempt in range(WRITE_ATTEMPTS):
                now = (remote.read_text(AUTHORIZED), remote.read_text(KNOWN))
                if now != base or attempt:
                    auth, known = wanted.merge(now[0] or "", now[1] or "")
                    if known.conflicts:
                        raise MeshkitError(
                            [c.describe(remote.host.label) for c in known.conflicts]
                            + ["known_hosts changed during mesh and now conflicts; nothing written"]
                        )
                    current = replace(planned, authorized=auth, known=known)
                    base = now
                new = (
                    current.authorized.text if current.authorized.changed else None,
                    current.known.text if current.known.changed else None,
                )
                if _put(remote, base, new):
                    return Written(current, cleaned, base != (fact.authorized, fact.known))
            raise MeshkitError(
                f"~/.ssh files kept changing while mesh wrote them ({WRITE_ATTEMPTS} tries); "
                "rerun mesh when nothing else edits them"
            )


def apply_unmesh(remote: Remote, change: UnmeshPlan, fact: NodeFacts, mesh: str) -> UnmeshPlan:
    """Under the ~/.ssh flock, re-read and take this mesh's lines off what is there now."""
    with remote.bounded("unmesh"), remote.locked(".ssh"):
        _clean_stale(remote)
        result = change
        for _ in range(WRITE_ATTEMPTS):
            now = (remote.read_text(AUTHORIZED), remote.read_text(KNOWN))
            if now != (fact.authorized, fact.known):
                auth, a_n, known, k_n = unmesh_texts(now[0], now[1], mesh)
                result = replace(
                    change, authorized=auth, authorized_removed=a_n, known=known, known_removed=k_n
                )
            new = (
                result.authorized if result.authorized_removed else None,
                result.known if result.known_removed else None,
            )
            if _put(remote, now, new):
                break
        else:
            raise MeshkitError("~/.ssh files kept changing during unmesh; rerun it")
        if result.remove_key:
            remote.remove(result.remove_key)
            remote.remove(result.remove_key + ".pub")
        return result


# ---------------------------------------------------------------- verify


def verify(
    cluster: Cluster, hosts: Sequence[Host], own: dict[Host, str] | None = None
) -> VerifyResult:
    """The N x N check, run on the nodes over the controller's existing connections, by the
    hostfile spelling and by each node's own hostname."""
    from ..meshplan import VERIFY_BATCH

    if own is None:
        own = {
            h: v
            for h, v in succeeded(cluster.each("names", own_hostname, hosts, quiet=True)).items()
        }
    # Each node makes its logins VERIFY_BATCH at a time; each batch may take up to connect_timeout:
    # budget the batches on top of the usual command timeout.
    batches = -(-2 * len(hosts) // VERIFY_BATCH)
    timeout = cluster.settings.command_timeout + cluster.settings.connect_timeout * batches
    rank = {h: i for i, h in enumerate(hosts)}

    def run(r: Remote) -> str:
        with r.bounded("verify", timeout):
            script = verify_script(hosts, cluster.settings.connect_timeout, rank[r.host], own)
            return r.run(script, timeout=timeout)[1]

    results = cluster.each("verify", run, hosts)
    out = VerifyResult(list(hosts))
    for source in hosts:
        outcome = results.get(source)
        if outcome is None or outcome.value is None:
            reason = (
                cluster.failures.get(source)
                or (outcome.error if outcome else None)
                or "unreachable"
            )
            out.failures += [
                PairFailure(source, t, f"controller cannot use {source.label}: {reason}")
                for t in hosts
            ]
        else:
            out.failures += parse_verify(source, hosts, outcome.value, own)
    return out


# ---------------------------------------------------------------- the operations


@dataclass
class NodeReport:
    host: Host
    user_key: str  # kept | create | created | derive | derived
    authorized_added: list[str] = field(default_factory=list)
    authorized_claimed: int = 0
    known_added: list[str] = field(default_factory=list)
    known_claimed: int = 0
    cleaned: int = 0
    result: str = "unchanged"  # changed | unchanged | failed (or "would change" in a dry run)
    error: str | None = None
    notes: list[str] = field(default_factory=list)


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

    @property
    def failed(self) -> list[NodeReport]:
        return [n for n in self.nodes if n.result == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.left_out and not (self.verify and self.verify.failures)


def _abort(failures: dict[Host, str], what: str) -> MeshAbort:
    lines = [f"{what}: {len(failures)} node(s) failed, so no node was changed:"]
    lines += [f"  {h.label}: {err}" for h, err in failures.items()]
    lines.append("  fix them, or rerun with --skip-unreachable to leave them out")
    return MeshAbort(lines)


def _node_report(f: NodeFacts, p: NodePlan, dry_run: bool) -> NodeReport:
    verb = {"generate": "create", "derive": "derive", "kept": "kept"}[p.user_key]
    if not dry_run and verb != "kept":
        verb += "d"
    return NodeReport(
        f.host,
        verb,
        p.authorized.added,
        p.authorized.claimed,
        p.known.added,
        p.known.claimed,
        len(p.stale),
        ("would change" if dry_run else "changed") if p.changes else "unchanged",
        notes=list(f.notes),
    )


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
    with Cluster(hosts, settings, progress=progress) as cluster:
        inspected = cluster.each("inspect", inspect)
        failures = {**cluster.failures, **failed(inspected)}
        if failures and not skip_unreachable:
            raise _abort(failures, "mesh")
        facts = [f for h in hosts if (f := succeeded(inspected).get(h)) is not None]
        if not facts:
            raise MeshAbort("mesh: no node is reachable")
        report.left_out = failures
        kept, shared = drop_shared_addresses({f.host: f.names for f in facts})
        for f in facts:
            f.names = tuple(kept[f.host])
        report.notes = shared
        report.names = {f.host: list(f.names) for f in facts}
        live = [f.host for f in facts]
        if dry_run:
            shown = [
                f if f.user.key else replace(f, user=replace(f.user, key=placeholder_key(f.host)))
                for f in facts
            ]
            plans = plan(shown, mesh_id)
            for f in facts:
                plans[f.host].user_key = f.user.action
            stop = conflicts(facts, plans)
            if stop:
                raise MeshkitError([*stop, "mesh: conflicts; nothing would be written"])
            report.nodes = [_node_report(f, plans[f.host], True) for f in facts]
            return report
        # Conflicts between names are known before any key is made: stop before writing.
        stop = conflicts(facts, plan(facts, mesh_id))
        if stop:
            raise MeshkitError([*stop, "mesh: conflicts; nothing was written"])
        todo = [f for f in facts if f.user.action != "kept"]
        made = cluster.each(
            "keys",
            lambda r: make_user_key(r, next(f.user for f in todo if f.host == r.host)),
            [f.host for f in todo],
        )
        bad = failed(made)
        if bad:
            raise MeshkitError(
                [f"  {h.label}: {e}" for h, e in bad.items()]
                + ["mesh: user keys failed; authorized_keys and known_hosts were not changed"]
            )
        for f in facts:
            f.user = succeeded(made).get(f.host, f.user)
        plans = plan(facts, mesh_id)
        stop = conflicts(facts, plans)
        if stop:
            raise MeshkitError([*stop, "mesh: conflicts; nothing was written"])
        wanted = entries(facts, mesh_id)
        by_host = {f.host: f for f in facts}
        needed = [h for h in live if plans[h].changes]
        written = cluster.each(
            "install", lambda r: install(r, by_host[r.host], plans[r.host], wanted), needed
        )
        for f in facts:
            outcome = written.get(f.host)
            p = outcome.value.plan if outcome and outcome.value else plans[f.host]
            node = _node_report(f, p, False)
            if outcome is not None and outcome.value is not None:
                node.cleaned = outcome.value.cleaned
                if outcome.value.remerged:
                    node.notes.append("files changed since inspect: merged again before writing")
            if outcome is not None and outcome.error is not None:
                node.result, node.error = "failed", outcome.error
            report.nodes.append(node)
        if check and not report.failed:
            report.verify = verify(cluster, live, {f.host: f.hostname for f in facts})
    return report


def check(
    hosts: Sequence[Host], settings: Settings, progress: ProgressFn | None = None
) -> VerifyResult:
    """Every pair, from the nodes themselves, by the hostfile spelling and by hostname."""
    with Cluster(hosts, settings, progress=progress) as cluster:
        return verify(cluster, hosts)


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
        return [n for n in self.nodes if n.result == "failed"]


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
    with Cluster(hosts, settings, progress=progress) as cluster:
        inspected = cluster.each("inspect", inspect)
        failures = {**cluster.failures, **failed(inspected)}
        if failures:
            raise _abort(failures, "unmesh")
        facts = succeeded(inspected)
        changes = {h: plan_unmesh(f, mesh_id, keep_keys) for h, f in facts.items()}
        if not dry_run:
            done = cluster.each(
                "remove",
                lambda r: apply_unmesh(r, changes[r.host], facts[r.host], mesh_id),
                [h for h in hosts if changes[h].changes],
            )
        for h in hosts:
            ch = changes[h]
            node = UnmeshNode(
                h, ch, ("would change" if dry_run else "removed") if ch.changes else "unchanged"
            )
            if not dry_run and h in done:
                if done[h].error is not None:
                    node.result, node.error = "failed", done[h].error
                elif done[h].value is not None:
                    node.plan = done[h].value  # type: ignore[assignment]
            report.nodes.append(node)
    return report
