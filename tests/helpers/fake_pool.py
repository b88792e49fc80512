"""A small fake cluster for the ops layer (in the spirit of invoke's MockContext): three hosts whose
agents answer each operation from canned replies, so the ops logic runs without a sandbox."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meshkit import protocol as p
from meshkit.errors import MeshkitError
from meshkit.hostfile import Host
from meshkit.outcome import Outcome
from meshkit.remote.agent import read_reply

HOSTS = [Host("10.0.0.1", lineno=1), Host("10.0.0.2", lineno=2), Host("10.0.0.3", lineno=3)]


def env_ok(rank: int, port: int = 25000, master: str = "10.0.0.1") -> p.EnvReply:
    data = {"NODE_RANK": str(rank), "NNODES": "3", "MASTER_ADDR": master}
    data |= {"MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "eth0"}
    return p.EnvReply(data, "hostfile", f"10.0.0.{rank + 1} on eth0", "hostfile: eth0")


class FakePool:
    """Each node answers from ``replies[op][host]``: a Reply, an exception to raise, or the
    raw reply line a node sent (newline left out), read as the real agent client reads it."""

    def __init__(self, replies: dict[str, dict[Host, object]], failures=None) -> None:
        self.replies = replies
        self.failures = dict(failures or {})
        self.calls: list[tuple[str, Host, p.Request]] = []
        self.files: dict[tuple[Host, str], str] = {}
        # each written file's mode, and the root below which no link is followed
        self.modes: dict[tuple[Host, str], int] = {}
        self.roots: dict[tuple[Host, str], str] = {}
        self.reconnected: list[Host] = []

    def call_all(
        self,
        phase: str,
        request_for: Callable[[Host], p.Request | None],
        expect: type,
        hosts: Sequence[Host] | None = None,
        timeout: float | None = None,
    ) -> dict[Host, Outcome]:
        out = {}
        for host in hosts if hosts is not None else HOSTS:
            if host in self.failures:
                continue
            request = request_for(host)
            if request is None:
                continue
            op = p.op_of(request)
            self.calls.append((op, host, request))
            answer = self.replies.get(op, {}).get(host)
            if isinstance(answer, str):
                try:
                    answer = read_reply(request, f"{answer}\n".encode(), expect)
                except MeshkitError as exc:
                    answer = exc
            if isinstance(answer, Exception):
                out[host] = Outcome(exc=answer, error=str(answer))
            else:
                assert isinstance(answer, expect), (op, host, answer)
                out[host] = Outcome(answer)
        return out

    def write_file(
        self, host: Host, path: str, text: str, mode: int = 0o644, root: str = ""
    ) -> None:
        self.files[(host, path)] = text
        self.modes[(host, path)] = mode
        self.roots[(host, path)] = root

    def reconnect(self, host: Host) -> None:
        """Recorded: a down node stays as ``failures`` and ``replies`` say."""
        self.reconnected.append(host)


def healthy(**override: dict[Host, object]) -> dict[str, dict[Host, object]]:
    """Every node's answer when all is well: its rank, no other job, the master port free, started,
    running and stoppable; ``override`` replaces whole operations."""
    base: dict[str, dict[Host, object]] = {
        "env": {host: env_ok(rank) for rank, host in enumerate(HOSTS)},
        "jobs": {host: p.JobsReply([]) for host in HOSTS},
        "ports": {HOSTS[0]: p.PortsReply([p.PortState(25000, True)], False)},
        "start": {host: p.StartReply(True, "running", [], []) for host in HOSTS},
        "status": {host: p.StatusReply("running", None, 1.7e9, "step 3") for host in HOSTS},
        "stop": {host: p.StopReply(True, 4, []) for host in HOSTS},
        "events": {host: p.EventsReply([]) for host in HOSTS},
        # a failure's cause record (the supervisor's): no rank left an error file, an empty log
        "diagnose": {host: p.DiagnoseReply("exited", 1, None, [], [], []) for host in HOSTS},
        "logs": {host: p.LogsReply([], 0) for host in HOSTS},
    }
    return base | override
