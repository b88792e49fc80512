"""What every op talks to: one agent per node (``NodePool``, the protocol the ops are written
against; ``remote.AgentPool`` is the real one, tests pass a double), the SSH connections for the
ops that run commands over SSH itself (``NodeConnections``), and how the pool is opened from the
configuration (``connect``)."""

from __future__ import annotations

import contextlib
import getpass
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..hostfile import Host
from ..outcome import Outcome, ProgressFn
from ..protocol import Reply, Request
from ..settings import Config

if TYPE_CHECKING:  # importing remote pulls in paramiko: only where it connects
    from ..remote.agent import AgentPool
    from ..remote.connection import Remote, Settings

R = TypeVar("R", bound=Reply)
T = TypeVar("T")


class NodePool(Protocol):
    """One agent per node (``remote.AgentPool``, or a test double)."""

    @property
    def failures(self) -> dict[Host, str]: ...

    def call_all(
        self,
        phase: str,
        request_for: Callable[[Host], Request | None],
        expect: type[R],
        hosts: Sequence[Host] | None = None,
        timeout: float | None = None,
    ) -> dict[Host, Outcome[R]]: ...

    def write_file(
        self, host: Host, path: str, text: str, mode: int = 0o644, root: str = ""
    ) -> None:
        """Write ``path`` on ``host``; below ``root`` no link is followed (empty: ``path``'s
        own directory, taken where it leads)."""
        ...

    def reconnect(self, host: Host) -> None:
        """Open ``host``'s connection and agent again, after it went down; raises while it is
        still down (``top`` watching a node come back)."""
        ...


class NodeConnections(Protocol):
    """The SSH connection to every reachable node (``remote.SshGroup``, or an ``AgentPool``'s):
    what mesh's N x N ``verify`` runs over, for ``meshkit check`` and the doctor alike."""

    @property
    def settings(self) -> Settings: ...

    @property
    def failures(self) -> dict[Host, str]: ...

    def each(
        self,
        phase: str,
        fn: Callable[[Remote], T],
        hosts: Sequence[Host] | None = None,
        quiet: bool = False,
    ) -> dict[Host, Outcome[T]]: ...


def unanswered(outcome: Outcome[R] | None, host: Host, failures: dict[Host, str]) -> str:
    """Why a node gave no reply: its call's error, else why it could not be connected to."""
    if outcome is not None and outcome.error:
        return outcome.error
    return f"unreachable: {failures.get(host, 'unknown')}"


def ssh_settings(
    conf: Config,
    hostfile: str,
    identity: str | None = None,
    password: bool = False,
    accept_new: bool = False,
) -> Settings:
    """Connection settings from config and flags; the ssh_config beside the hostfile is read too.
    ``password``: ask for one on the terminal (``mesh --password``)."""
    from ..remote import Settings

    beside = Path(hostfile).parent / "ssh_config"
    configs = [str(path) for path in (conf.ssh_config, beside) if path and Path(path).is_file()]
    secret = getpass.getpass("SSH password for all nodes: ") if password else None
    return Settings(
        connect_timeout=conf.connect_timeout,
        command_timeout=conf.command_timeout,
        identity=identity or conf.identity,
        password=secret,
        accept_new=accept_new,
        ssh_configs=tuple(configs),
        user=conf.user,
        port=conf.port,
        parallel=conf.parallel,
    )


@contextlib.contextmanager
def connect(
    conf: Config,
    hostfile: str,
    hosts: Sequence[Host],
    python: str,
    progress: ProgressFn | None = None,
    wait: float = 0.0,
) -> Iterator[AgentPool]:
    """One connection and one node agent per node for the whole command, closed on the way out
    (Ctrl-C included). ``wait``: seconds to keep retrying nodes that do not answer yet."""
    from ..remote import AgentPool

    with AgentPool.connect(hosts, ssh_settings(conf, hostfile), python, progress, wait) as pool:
        yield pool
