"""Rank discovery on this node: gathers the inputs (environment, hostfile, addresses) and hands
them to the pure core. What ``meshkit env`` and ``meshkit run`` call; never imports fabric or
torch."""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import hostfile, localnet, sources, topology
from .distenv import NodeEnv, combine, master_problem
from .errors import HostfileError, JobError, SourceError, TopologyError, UsageError
from .hostfile import Host
from .jobindex import index_file
from .record import record, replace
from .trust import ROOT, read_trusted

TYPE_CHECKING = False  # no runtime `typing` on the env path (see meshkit/__init__.py)
if TYPE_CHECKING:
    from .job import Job

MAX_HOSTFILE_BYTES = 4 * 1024 * 1024
MAX_JOB_FILE_BYTES = 4 * 1024 * 1024  # a job file: its command, setup and environment


def read_hosts(
    path: str | os.PathLike[str],
    include: str | None = None,
    exclude: str | None = None,
    spares: bool = False,
) -> list[Host]:
    """Read, parse, filter and duplicate-check a hostfile (names resolved here): the nodes that
    take ranks, in rank order, and with ``spares`` the spare lines too (in file order)."""
    hosts = _read_hosts(path, include, exclude).hosts
    if spares:
        return hosts
    active = hostfile.active(hosts)
    if not active:  # the filters kept only spares (a file of spares only does not parse)
        raise HostfileError(
            f"--include {include!r} / --exclude {exclude!r} leave only spare lines, which take "
            "no rank; check the names against the hostfile"
        )
    return active


@record
class _ResolvedHosts:
    """The hosts, and what each name resolves to here (looked up once: discovery needs it too)."""

    hosts: list[Host]
    addresses: dict[str, tuple[str, ...]]


def _read_hosts(
    path: str | os.PathLike[str], include: str | None, exclude: str | None
) -> _ResolvedHosts:
    # os.path, not pathlib: `meshkit env` runs on every node at every start
    path_text = os.fspath(path)
    # Root obeys only a hostfile no other user could have written (trust.py): it names the
    # machines root logs in to.
    as_root = os.getuid() == ROOT
    try:
        content = read_trusted(path_text, MAX_HOSTFILE_BYTES, "hostfile", check=as_root)
        if content is None:
            raise HostfileError(
                f"{path_text}: no such hostfile; create it (one node per line: "
                f"{hostfile.FORMAT}) or pass --hostfile"
            )
        text = content.decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"{path_text}: cannot read: {exc}") from None
    hosts = hostfile.select(hostfile.parse(text, path_text), include, exclude)
    names = dict.fromkeys(host.host for host in hosts)
    addresses = {name: localnet.resolve(name) for name in names}
    problems = hostfile.duplicate_problems(hosts, addresses, path_text)
    if problems:
        raise HostfileError(problems)
    return _ResolvedHosts(hosts, addresses)


def discover(
    hostfile_path: str | os.PathLike[str] | None = "hostfile",
    *,
    session: str = "meshkit",
    node_rank: int | None = None,
    master_port: int | None = None,
    nproc_per_node: int | None = None,
    include: str | None = None,
    exclude: str | None = None,
    environ: Mapping[str, str] | None = None,
    launch: str | None = None,
) -> NodeEnv:
    """This node's ``NodeEnv``: the first launcher source present, else the hostfile matched against
    this machine's addresses. The same inputs give the same answer on every node. ``launch``:
    a train's (its preflight): a saved job of another launch, and its membership, are not
    followed."""
    if environ is None:
        environ = os.environ
    env = dict(environ)
    if node_rank is not None:
        env["MESHKIT_NODE_RANK"] = str(node_rank)
    env.setdefault("MESHKIT_HOSTNAME", localnet.hostname())
    nodefile = _read_nodefile(env.get("PBS_NODEFILE"))
    placement = sources.from_environment(env, nodefile)
    # A launcher's placement makes the hostfile optional: it is read only when it exists.
    read_hostfile = hostfile_path is not None
    if placement is not None and hostfile_path is not None:
        read_hostfile = os.path.exists(hostfile_path)
    hosts: list[Host] | None = None
    resolved: dict[str, tuple[str, ...]] = {}
    if hostfile_path is not None and read_hostfile:
        read = _read_hosts(hostfile_path, include, exclude)
        hosts = read.hosts
        resolved = read.addresses
    match = None
    local = None
    # OpenMPI cannot tell which node this is: a hostfile, when there is one, decides.
    hostfile_decides = False
    if placement is not None and placement.hostfile_decides and hosts is not None:
        hostfile_decides = True
    spares: list[Host] = []
    if hosts is not None:
        spares = [host for host in hosts if host.spare]
        hosts = hostfile.active(hosts)
    if hosts is not None and (placement is None or hostfile_decides):
        local = localnet.local_addresses()
        addresses = [resolved[host.host] for host in hosts]
        this_host = env["MESHKIT_HOSTNAME"]
        try:
            match = topology.match_rank(hosts, addresses, local, this_host, str(hostfile_path))
        except TopologyError:
            spare_addresses = [resolved[host.host] for host in spares]
            spare = topology.spare_match(spares, spare_addresses, local, this_host)
            if spare is None:
                raise
            job = membership_job(str(hostfile_path), session, launch)
            if job is None or spare.label not in job.members:
                raise TopologyError(
                    f"{hostfile_path}:{spare.lineno}: this machine ({this_host}) is a spare of "
                    "this hostfile: it takes no rank until a supervised job's membership gives "
                    "it one (`meshkit status` shows the membership); remove 'spare' from its "
                    "line to give it a rank"
                ) from None
            # a spare that took a lost node's rank: its place is in the job's membership
            return in_membership(job, session, master_port, nproc_per_node, env)
        # the job's membership changed (a node lost, the master moved, a shrink): its place
        # there, not its line's, is this node's rank
        job = membership_job(str(hostfile_path), session, launch)
        if job is not None:
            this = hosts[match.rank]
            if this.label not in job.members:
                raise TopologyError(
                    f"{hostfile_path}:{this.lineno}: this machine ({this_host}) is not in the "
                    f"membership of session {session}'s job (generation {job.generation}): it "
                    "was lost and its rank went to a spare, or the job shrank without it; it is "
                    "a spare of that job now (`meshkit status` shows the membership; "
                    "`meshkit train --cmd CMD` starts a new job on the hostfile's nodes)"
                )
            return in_membership(job, session, master_port, nproc_per_node, env)
    if placement is not None and placement.verify_master and not hostfile_decides:
        master_addresses: tuple[str, ...] = ()
        if placement.master_addr:
            master_addresses = localnet.resolve(placement.master_addr)
        local_addresses = [entry.address for entry in localnet.local_addresses()]
        problem = master_problem(placement, master_addresses, local_addresses)
        if problem:
            raise SourceError(problem)
    node = combine(
        placement,
        hosts,
        match,
        session=session,
        master_port=master_port,
        nproc_per_node=nproc_per_node,
        gpu_count=localnet.gpu_count,
    )
    return with_interface(node, match, env, local)


def in_membership(
    job: Job,
    session: str,
    master_port: int | None,
    nproc_per_node: int | None,
    environ: dict[str, str],
) -> NodeEnv:
    """This node's place in ``job``'s membership (its own hostfile, the nodes in rank order),
    with the job's port and processes per node unless given."""
    if master_port is None:
        master_port = job.master_port
    if nproc_per_node is None:
        nproc_per_node = job.nproc_per_node
    return discover(
        job.node_hostfile,
        session=session,
        master_port=master_port,
        nproc_per_node=nproc_per_node,
        environ=environ,
    )


def membership_job(hostfile_path: str, session: str, launch: str | None = None) -> Job | None:
    """The saved job of ``session`` beside this hostfile (through its index, as ``status`` finds
    it) when its membership changed since its launch; None when there is no such job, it does
    not read, its membership is the hostfile's, or it is not ``launch`` (a new train's
    preflight: the earlier launch's membership is not the new one's)."""
    index = index_file(os.path.abspath(hostfile_path), session)
    index_text = _read_small(index)
    if index_text is None:
        return None  # no job here (most starts): nothing more is read or imported
    # imported here: only a node beside a saved job reads it
    from .job import check_session, from_json, job_file, workdir_from_index

    try:
        check_session(session)
        workdir = workdir_from_index(index_text, index)
        job_path = str(job_file(workdir, session))
        job_text = _read_small(job_path)
        if job_text is None:
            return None
        job = from_json(job_text, job_path)
    except (JobError, UsageError):
        return None
    if not job.members:
        return None
    if launch is not None and job.launch != launch:
        return None
    return job


def _read_small(path: str) -> str | None:
    """A job's file or index (at most ``MAX_JOB_FILE_BYTES``); None when it cannot be read."""
    try:
        with open(path, "rb") as stream:
            return stream.read(MAX_JOB_FILE_BYTES).decode(errors="replace")
    except OSError:
        return None


def with_interface(
    node: NodeEnv,
    match: topology.Match | None,
    environ: Mapping[str, str],
    local: list[topology.LocalAddress] | None = None,
) -> NodeEnv:
    """Add GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME: the interface of the hostfile address that placed
    this node, else (a launcher placed it, or the hostfile matched by hostname) the interface of
    the route to MASTER_ADDR. The user's own settings win; with both set nothing is looked up."""
    chosen = None
    user_set_all = all(environ.get(name) for name in topology.SOCKET_IFNAME_VARIABLES)
    if not user_set_all:
        if match is not None:
            chosen = topology.interface_of_match(match)
        if chosen is None:
            if local is None:
                local = localnet.local_addresses()
            chosen = topology.interface_by_route(
                node.master_addr,
                localnet.route_sources(node.master_addr, node.master_port),
                local,
                node.nnodes,
            )
    ifnames = topology.socket_ifnames(chosen, environ)
    return replace(
        node,
        socket_ifnames=tuple(ifnames.variables.items()),
        interface_source=ifnames.reason,
    )


def _read_nodefile(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path) as stream:
            return stream.read()
    except OSError as exc:
        raise SourceError(f"PBS_NODEFILE={path}: cannot read: {exc}") from None
