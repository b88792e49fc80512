"""One node's single SSH connection (fabric over paramiko): strict host keys, the host keys sshd
announces after authentication, and a deadline on every call (``Remote``). The shell that mesh and
unmesh work through on that connection is ``node_shell``'s."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko
from fabric import Config as FabricConfig
from fabric import Connection
from invoke.exceptions import CommandTimedOut

from ..errors import PhaseTimeout, UsageError
from ..hostfile import Host
from ..trust import read_config

# paramiko logs a connection's failure from its own thread (a banner never read, say): with no
# handler, logging's last resort printed that traceback on stderr whenever the thread got there
# before the command ended. meshkit reports every failure itself, as the exception it raises.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class UnknownHostKey(paramiko.SSHException):
    """A host key known_hosts lacks, or (``revoked``) one it marks @revoked: refused."""

    def __init__(self, hostname: str, key: paramiko.PKey, revoked: bool = False) -> None:
        self.hostname = hostname
        self.kind = key.get_name()
        self.fingerprint = fingerprint(key)
        self.revoked = revoked
        super().__init__(f"{'revoked' if revoked else 'unknown'} host key for {hostname}")


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint of a key (as ``ssh-keygen -lf`` shows it)."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


HOSTKEYS = "hostkeys-00@openssh.com"
MAX_ANNOUNCED = 64  # host keys one sshd may announce: more is not a host
SSH_PORT = 22


class HostKeysTransport(paramiko.Transport):
    """A client transport that keeps the host keys sshd announces after authentication
    (``hostkeys-00@openssh.com``, OpenSSH's PROTOCOL, "Host key rotation"): paramiko's client
    refuses every global request a server sends, and so drops them. ``announced`` stays None when
    sshd announces nothing (an sshd older than 6.8, or not OpenSSH)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.announced: list[bytes] | None = None
        table: dict[int, Any] = self._handler_table  # type: ignore[attr-defined]
        self._refuse = table[paramiko.common.MSG_GLOBAL_REQUEST]
        table[paramiko.common.MSG_GLOBAL_REQUEST] = self._server_request

    def _server_request(self, message: paramiko.Message) -> None:
        if message.get_text() == HOSTKEYS:
            message.get_boolean()
            blobs: list[bytes] = []
            while message.get_remainder() and len(blobs) < MAX_ANNOUNCED:
                blobs.append(message.get_binary())
            self.announced = blobs
        message.rewind()
        self._refuse(message)  # answered as paramiko answers any server request (no reply wanted)


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown host keys (naming the fingerprint), or with ``accept_new`` trust them on first
    use and record them, as OpenSSH's StrictHostKeyChecking=accept-new does. A *changed* key is
    refused by paramiko itself (BadHostKeyException), always."""

    _lock = threading.Lock()

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def missing_host_key(self, client: paramiko.SSHClient, name: str, key: paramiko.PKey) -> None:
        if not self.settings.accept_new:
            raise UnknownHostKey(name, key)
        client.get_host_keys().add(name, key.get_name(), key)
        if not self.settings.record_new_host_keys:
            return  # --dry-run: trusted for this run only, written nowhere
        store = self.settings.known_hosts_store
        with self._lock:
            store.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(store, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as out:
                out.write(f"{name} {key.get_name()} {key.get_base64()}\n")


@dataclass(frozen=True)
class Settings:
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    identity: str | None = None
    password: str | None = None
    accept_new: bool = False
    ssh_configs: tuple[str, ...] = ()
    user: str | None = None
    port: int | None = None
    parallel: int = 32
    record_new_host_keys: bool = True  # False under --dry-run: accept-new writes nothing
    known_hosts_store: Path = field(default_factory=lambda: Path("~/.ssh/known_hosts").expanduser())


MAX_SSH_CONFIG_BYTES = 1 << 20


def ssh_config(paths: Sequence[str]) -> paramiko.SSHConfig:
    """~/.ssh/config plus extra files, parsed like OpenSSH (first value found wins). Each is
    read only when trusted as OpenSSH trusts ~/.ssh/config (``trust.read_trusted``): its
    ``ProxyCommand`` and ``Match exec`` run as this user."""
    config = paramiko.SSHConfig()
    for path in [str(Path("~/.ssh/config").expanduser()), *paths]:
        try:
            content = read_config(path, MAX_SSH_CONFIG_BYTES, "ssh_config")
        except OSError as exc:
            raise UsageError(f"{path}: cannot read this ssh_config: {exc}") from None
        if content is None:
            continue
        config.parse(io.StringIO(content.decode(errors="replace")))
    return config


class GatewayError(paramiko.SSHException):
    """A ProxyJump hop failed (its host key, its login): which hop, and why."""

    def __init__(self, hop: str, cause: BaseException) -> None:
        self.hop = hop
        self.cause = cause
        super().__init__(f"gateway {hop}: {cause}")


@dataclass(frozen=True)
class KnownHosts:
    """One known_hosts file as paramiko can use it, parsed once: each usable line's names and key
    in file order, which lines name each host, and the ``@revoked`` keys (type, base64). A line
    paramiko cannot parse (``@cert-authority``, a key type it lacks) is skipped instead of failing
    the whole file, as OpenSSH would still connect by the other lines."""

    lines: tuple[tuple[tuple[str, ...], paramiko.PKey], ...]
    naming: dict[str, tuple[int, ...]]  # a plain host name -> the lines that name it
    hashed: tuple[int, ...]  # lines with a hashed name (|1|...), which may name any host
    revoked: frozenset[tuple[str, str]]

    def add_to(self, keys: paramiko.HostKeys, name: str) -> None:
        """Add to ``keys`` what paramiko's lookup of ``name`` can find: the lines naming it and
        the hashed ones, in file order (a later line wins, as when the whole file is added), but
        not every other node's lines: each node's own lookup then costs the same at any N."""
        chosen = sorted({*self.naming.get(name, ()), *self.hashed})
        for index in chosen:
            names, key = self.lines[index]
            for each in names:
                if each == name or each.startswith("|1|"):
                    keys.add(each, key.get_name(), key)


def read_known_hosts(path: str) -> KnownHosts:
    """``path`` parsed, or the copy parsed before while the file is unchanged (its size and
    mtime): one parse per command instead of one per node, whose lines grow with N."""
    try:
        info = os.stat(path)
    except OSError:
        return KnownHosts((), {}, (), frozenset())
    stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
    with _KNOWN_HOSTS_LOCK:
        cached = _KNOWN_HOSTS.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        parsed = _parse_known_hosts(path)
        _KNOWN_HOSTS[path] = (stamp, parsed)
        return parsed


_KNOWN_HOSTS: dict[str, tuple[tuple[int, int, int], KnownHosts]] = {}
_KNOWN_HOSTS_LOCK = threading.Lock()


def _parse_known_hosts(path: str) -> KnownHosts:
    revoked: set[tuple[str, str]] = set()
    lines: list[tuple[tuple[str, ...], paramiko.PKey]] = []
    try:
        with open(path, errors="replace") as handle:
            text = handle.read(MAX_KNOWN_HOSTS)
    except OSError:
        return KnownHosts((), {}, (), frozenset())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("@"):
            parts = line.split()
            if parts[0] == "@revoked" and len(parts) >= 4:
                revoked.add((parts[2], parts[3]))
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
        except Exception:  # InvalidHostKey, bad base64, a key type paramiko lacks: skip the line
            continue
        if entry is not None and entry.key is not None:
            lines.append((tuple(entry.hostnames), entry.key))
    naming: dict[str, list[int]] = {}
    hashed = []
    for index, (names, _) in enumerate(lines):
        for name in names:
            if name.startswith("|1|"):
                hashed.append(index)
            else:
                naming.setdefault(name, []).append(index)
    indexed = {name: tuple(indices) for name, indices in naming.items()}
    return KnownHosts(tuple(lines), indexed, tuple(hashed), frozenset(revoked))


def _connect_kwargs(settings: Settings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "banner_timeout": settings.connect_timeout,
        "auth_timeout": settings.connect_timeout,
        "channel_timeout": settings.command_timeout,
    }
    if settings.identity:
        kwargs["key_filename"] = [str(Path(settings.identity).expanduser())]
    if settings.password is not None:
        kwargs["password"] = settings.password
    return kwargs


MAX_KNOWN_HOSTS = 16 << 20


class Remote:
    """One node's single SSH connection, with the operations the phases need."""

    def __init__(self, host: Host, settings: Settings, config: paramiko.SSHConfig) -> None:
        self.host = host
        self.settings = settings
        self.conn = Connection(
            host.host,
            user=host.user or settings.user,
            port=host.port or settings.port,
            config=FabricConfig(ssh_config=config),
            connect_timeout=settings.connect_timeout,
            connect_kwargs=_connect_kwargs(settings),
        )
        # Only the node's own connection: a gateway's announcements are not the node's keys.
        self.conn.connect_kwargs["transport_factory"] = HostKeysTransport
        self.revoked: set[tuple[str, str]] = set()
        # Every hop (ProxyJump gateways included) gets the strict policy and our known_hosts:
        # fabric opens gateways with AutoAddPolicy, which would trust any jump host.
        hop: Any = self.conn
        while isinstance(hop, Connection):
            self._harden(hop)
            hop = hop.gateway
        self._deadline: float | None = None

    def _harden(self, conn: Connection) -> None:
        settings = self.settings
        listed = conn.connect_kwargs.get("key_filename") or []
        if isinstance(listed, str):
            listed = [listed]
        if conn is not self.conn:
            # A gateway gets the same timeouts and --identity as the nodes behind it.
            conn.connect_timeout = int(settings.connect_timeout)
            extra = _connect_kwargs(settings)
            listed = [*extra.pop("key_filename", []), *listed]
            conn.connect_kwargs = {**extra, **conn.connect_kwargs}  # the gateway's own settings win
        # An IdentityFile that does not exist here (e.g. a controller's key named in a shared
        # ssh_config, seen from a node) is skipped, as OpenSSH does.
        conn.connect_kwargs["key_filename"] = [k for k in listed if Path(k).expanduser().is_file()]
        conn.client.set_missing_host_key_policy(StrictPolicy(settings))
        named = str(conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts")).split()
        files = ["/etc/ssh/ssh_known_hosts", "~/.ssh/known_hosts", *named]
        # The name paramiko looks the server's key up by (SSHClient.connect)
        port = int(conn.port)
        looked_up = str(conn.host) if port == SSH_PORT else f"[{conn.host}]:{port}"
        for path in dict.fromkeys(str(Path(name).expanduser()) for name in files):
            known = read_known_hosts(path)
            known.add_to(conn.client.get_host_keys(), looked_up)
            self.revoked |= known.revoked

    def open(self) -> Remote:
        gateway = self.conn.gateway
        if isinstance(gateway, Connection):
            try:
                gateway.open()
            except Exception as exc:
                raise GatewayError(str(gateway.host), exc) from exc
        self.conn.open()
        hop: Any = self.conn
        while isinstance(hop, Connection):
            key = hop.transport.get_remote_server_key() if hop.transport else None
            if key is not None and (key.get_name(), key.get_base64()) in self.revoked:
                self.close()
                raise UnknownHostKey(hop.host, key, revoked=True)
            hop = hop.gateway
        return self

    @property
    def server_key(self) -> tuple[str, str]:
        key = self.conn.transport.get_remote_server_key()
        return key.get_name(), key.get_base64()

    @property
    def session_id(self) -> bytes:
        """The exchange hash of the connection's first key exchange (what host key proofs sign)."""
        return bytes(self.conn.transport.session_id)

    def global_request(self, kind: str, data: Sequence[Any] = ()) -> paramiko.Message | None:
        """A global request that wants a reply: the reply's data, or None when sshd refuses it.
        Bounded by the phase's deadline (paramiko's own ``global_request`` waits forever)."""
        transport: Any = self.conn.transport
        done = threading.Event()
        transport.completion_event = done  # paramiko sets it on the reply, success or failure
        message = paramiko.Message()
        message.add_byte(paramiko.common.cMSG_GLOBAL_REQUEST)
        message.add_string(kind)
        message.add_boolean(True)
        message.add(*data)
        transport._send_user_message(message)
        if not done.wait(self.remaining()):
            raise TimeoutError(f"no answer to {kind}")
        reply: paramiko.Message | None = transport.global_response
        return reply

    def announced_host_keys(self) -> list[bytes] | None:
        """The host key blobs sshd announced after authentication, or None when it announced
        none. sshd sends them before it reads any request of ours, so once one request of ours
        has been answered, an announcement not here was never sent."""
        transport: Any = self.conn.transport
        if getattr(transport, "announced", None) is None:
            self.global_request("keepalive@openssh.com")  # refused; only the round trip matters
        return getattr(transport, "announced", None)

    @property
    def address(self) -> tuple[str, int]:
        """What this connection reached: the HostName (after ssh_config) and the port."""
        return str(self.conn.host), int(self.conn.port)

    @property
    def peer(self) -> str | None:
        """The peer's address, when the connection is a direct TCP socket (not via a gateway)."""
        sock = self.conn.transport.sock if self.conn.transport else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                return str(sock.getpeername()[0])
        return None

    def key_probe_socket(self) -> Any:
        """A fresh byte stream to this node's sshd (the same route as the connection, through the
        gateway if any) for a key-exchange-only handshake: nobody logs in over it."""
        gateway = self.conn.gateway
        host, port = self.address
        if isinstance(gateway, Connection) and gateway.transport is not None:
            return gateway.transport.open_channel(
                "direct-tcpip", (host, port), ("", 0), timeout=self.settings.connect_timeout
            )
        if isinstance(gateway, str):
            return None  # a ProxyCommand: not ours to start again
        return socket.create_connection((host, port), timeout=self.settings.connect_timeout)

    @contextlib.contextmanager
    def bounded(self, phase: str, seconds: float | None = None) -> Iterator[None]:
        """Everything inside finishes within ``seconds`` (default: command_timeout) in total, or
        PhaseTimeout names the phase and that timeout; the connection is then closed, so nothing
        (not even a cleanup) waits on the dead link again."""
        limit = self.settings.command_timeout if seconds is None else seconds
        self._deadline = time.monotonic() + limit
        try:
            yield
        except (socket.timeout, TimeoutError, CommandTimedOut):
            self.close()
            raise PhaseTimeout(phase, limit) from None
        except (paramiko.SSHException, EOFError, OSError):
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self.close()
                raise PhaseTimeout(phase, limit) from None
            raise
        finally:
            self._deadline = None

    def remaining(self) -> float:
        if self._deadline is None:
            return self.settings.command_timeout
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def run(self, command: str, timeout: float | None = None) -> tuple[int, str, str]:
        """A command line (built with shlex.join by the caller): its exit code, stdout, stderr."""
        limit = self.remaining() if timeout is None else timeout
        result = self.conn.run(
            command, hide=True, warn=True, in_stream=False, pty=False, timeout=limit
        )
        return result.exited, result.stdout, result.stderr

    def close(self) -> None:
        self.conn.close()
