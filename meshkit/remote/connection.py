"""One node's single SSH connection (fabric over paramiko): strict host keys, a timeout on every
call, atomic SFTP writes (temp file + rename, explicit modes)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import shlex
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import paramiko
from fabric import Config as FabricConfig
from fabric import Connection
from invoke.exceptions import CommandTimedOut

from ..errors import MeshkitError, PhaseTimeout
from ..hostfile import Host

# paramiko logs a connection's failure from its own thread (a banner never read, say): with no
# handler, logging's last resort printed that traceback on stderr whenever the thread got there
# before the command ended. meshkit reports every failure itself, as the exception it raises.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, kind: str, fingerprint: str) -> None:
        self.hostname, self.kind, self.fingerprint = hostname, kind, fingerprint
        super().__init__(f"unknown host key for {hostname}")


def fingerprint(key: paramiko.PKey) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown host keys (naming the fingerprint), or with ``accept_new`` trust them on first
    use and record them, as OpenSSH's StrictHostKeyChecking=accept-new does. A *changed* key is
    refused by paramiko itself (BadHostKeyException), always."""

    _lock = threading.Lock()

    def __init__(self, accept_new: bool, store: Path, record: bool = True) -> None:
        self.accept_new, self.store, self.record = accept_new, store, record

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if not self.accept_new:
            raise UnknownHostKey(hostname, key.get_name(), fingerprint(key))
        client.get_host_keys().add(hostname, key.get_name(), key)
        if not self.record:
            return  # --dry-run: trusted for this run only, written nowhere
        with self._lock:
            self.store.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.store, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as out:
                out.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


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


def ssh_config(paths: Sequence[str]) -> paramiko.SSHConfig:
    """~/.ssh/config plus extra files, parsed like OpenSSH (first value found wins)."""
    config = paramiko.SSHConfig()
    for path in [str(Path("~/.ssh/config").expanduser()), *paths]:
        if Path(path).is_file():
            with open(path) as handle:
                config.parse(handle)
    return config


class GatewayError(paramiko.SSHException):
    """A ProxyJump hop failed (its host key, its login): which hop, and why."""

    def __init__(self, hop: str, cause: BaseException) -> None:
        self.hop, self.cause = hop, cause
        super().__init__(f"gateway {hop}: {cause}")


class RevokedHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        self.hostname, self.kind, self.fingerprint = hostname, key.get_name(), fingerprint(key)
        super().__init__(f"revoked host key for {hostname}")


def load_known_hosts(keys: paramiko.HostKeys, path: str) -> set[tuple[str, str]]:
    """Load what paramiko can use of an OpenSSH known_hosts, line by line: a line it cannot parse
    (``@cert-authority``, a key type it lacks) is skipped instead of failing the whole file, as
    OpenSSH would still connect by the other lines. Returns the ``@revoked`` keys (type, base64)."""
    revoked: set[tuple[str, str]] = set()
    try:
        with open(path, errors="replace") as handle:
            text = handle.read(MAX_KNOWN_HOSTS)
    except OSError:
        return revoked
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
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return revoked


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
MAX_READ = 4 << 20  # a node's file meshkit reads (authorized_keys, known_hosts, /proc/...)


class Remote:
    """One node's single SSH connection, with the operations the phases need."""

    def __init__(self, host: Host, settings: Settings, config: paramiko.SSHConfig) -> None:
        self.host, self.settings = host, settings
        self.conn = Connection(
            host.host,
            user=host.user or settings.user,
            port=host.port or settings.port,
            config=FabricConfig(ssh_config=config),
            connect_timeout=settings.connect_timeout,
            connect_kwargs=_connect_kwargs(settings),
        )
        self.revoked: set[tuple[str, str]] = set()
        # Every hop (ProxyJump gateways included) gets the strict policy and our known_hosts:
        # fabric opens gateways with AutoAddPolicy, which would trust any jump host.
        hop: Any = self.conn
        while isinstance(hop, Connection):
            self._harden(hop)
            hop = hop.gateway
        self._sftp: paramiko.SFTPClient | None = None
        self._deadline: float | None = None

    def _harden(self, conn: Connection) -> None:
        settings = self.settings
        listed = conn.connect_kwargs.get("key_filename") or []
        if isinstance(listed, str):
            listed = [listed]
        if conn is not self.conn:
            # A gateway gets the same timeouts and --identity as the nodes behind it.
            conn.connect_timeout = int(settings.connect_timeout)
            for k, v in _connect_kwargs(settings).items():
                if k == "key_filename":
                    listed = [*v, *listed]
                else:
                    conn.connect_kwargs.setdefault(k, v)
        # An IdentityFile that does not exist here (e.g. a controller's key named in a shared
        # ssh_config, seen from a node) is skipped, as OpenSSH does.
        conn.connect_kwargs["key_filename"] = [k for k in listed if Path(k).expanduser().is_file()]
        client = conn.client
        client.set_missing_host_key_policy(
            StrictPolicy(
                settings.accept_new, settings.known_hosts_store, settings.record_new_host_keys
            )
        )
        for path in self._known_hosts_files(conn):
            self.revoked |= load_known_hosts(client.get_host_keys(), path)

    @staticmethod
    def _known_hosts_files(conn: Connection) -> list[str]:
        listed = str(conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts")).split()
        candidates = ["/etc/ssh/ssh_known_hosts", "~/.ssh/known_hosts", *listed]
        return [
            p
            for p in dict.fromkeys(str(Path(c).expanduser()) for c in candidates)
            if Path(p).is_file()
        ]

    def open(self) -> Remote:
        gateway = self.conn.gateway
        if isinstance(gateway, Connection):
            try:
                gateway.open()
            except GatewayError:
                raise
            except Exception as exc:
                raise GatewayError(str(gateway.host), exc) from exc
        self.conn.open()
        hop: Any = self.conn
        while isinstance(hop, Connection):
            key = hop.transport.get_remote_server_key() if hop.transport else None
            if key is not None and (key.get_name(), key.get_base64()) in self.revoked:
                self.close()
                raise RevokedHostKey(hop.host, key)
            hop = hop.gateway
        return self

    @property
    def server_key(self) -> tuple[str, str]:
        key = self.conn.transport.get_remote_server_key()
        return key.get_name(), key.get_base64()

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

    # ------------------------------------------------------------ deadlines

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

    def run(
        self, command: str, timeout: float | None = None, out: TextIO | None = None
    ) -> tuple[int, str, str]:
        """A command line (built with shlex.join by the caller); its exit code, stdout and stderr.
        With ``out``, both streams are written there as they arrive instead (and no timeout
        applies unless given: for --follow)."""
        if timeout is None and out is None:
            timeout = self.remaining()
        result = self.conn.run(
            command,
            hide=out is None,
            warn=True,
            in_stream=False,
            pty=False,
            timeout=timeout,
            **({"out_stream": out, "err_stream": out} if out else {}),
        )
        return result.exited, result.stdout, result.stderr

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self.conn.sftp()
        channel = self._sftp.get_channel()
        if channel is not None:
            channel.settimeout(self.remaining())
        return self._sftp

    # ------------------------------------------------------------ files (paths relative to home)

    def read_text(self, path: str, limit: int = MAX_READ) -> str | None:
        """A file's text, or None when it does not exist; more than ``limit`` bytes is an error."""
        try:
            with self.sftp.open(path, "r") as handle:
                data = handle.read(limit + 1)
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise MeshkitError(f"{path} is larger than {limit} bytes; meshkit will not read it")
        return data.decode(errors="replace")

    def lstat(self, path: str) -> tuple[int | None, int | None, str]:
        """``(st_mode, uid, link target)`` without following a link; st_mode None when missing."""
        try:
            st = self.sftp.lstat(path)
        except FileNotFoundError:
            return None, None, ""
        target = ""
        if stat.S_ISLNK(st.st_mode or 0):
            with contextlib.suppress(OSError):
                target = self.sftp.readlink(path) or ""
        return st.st_mode, st.st_uid, target

    def home(self) -> str:
        return str(self.sftp.normalize("."))

    def exists(self, path: str) -> bool:
        try:
            self.sftp.lstat(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str) -> list[str]:
        try:
            return list(self.sftp.listdir(path))
        except FileNotFoundError:
            return []

    def ensure_dir(self, path: str, mode: int = 0o700) -> None:
        """Create ``path`` with ``mode`` if missing; an existing one is left exactly as it is."""
        try:
            self.sftp.mkdir(path, mode)
            self.sftp.chmod(path, mode)  # mkdir's mode is subject to the server's umask
        except OSError:
            if not self._is_dir(path):
                raise

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """``mkdir -p``: create the missing directories (existing ones keep their mode)."""
        missing = []
        current = path.rstrip("/") or "/"
        while current not in ("", "/") and not self._is_dir(current):
            missing.append(current)
            current = current.rsplit("/", 1)[0] or "/"
        for directory in reversed(missing):
            try:
                self.sftp.mkdir(directory, mode)
            except OSError:
                if not self._is_dir(directory):
                    raise

    def _is_dir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(self.sftp.stat(path).st_mode or 0)
        except OSError:
            return False

    def write_temp(self, path: str, text: str, mode: int = 0o600) -> str:
        """A temp file beside ``path`` (mode set before any data), for ``rename`` to put in place."""
        head, _, name = path.rpartition("/")
        tmp = f"{head + '/' if head else ''}.{name}.meshkit-{uuid.uuid4().hex[:12]}"
        try:
            with self.sftp.open(tmp, "wx") as handle:
                self.sftp.chmod(tmp, mode)
                handle.write(text.encode())
        except BaseException:
            self.discard(tmp)
            raise
        return tmp

    def rename(self, tmp: str, path: str) -> None:
        try:
            self.sftp.posix_rename(tmp, path)
        except BaseException:
            self.discard(tmp)
            raise

    def discard(self, tmp: str) -> None:
        """Best effort, never waiting on a dead link: the next run cleans what is left."""
        if self.conn.transport is None or not self.conn.transport.is_active():
            return
        with contextlib.suppress(Exception):
            self.sftp.remove(tmp)

    def write_atomic(self, path: str, text: str, mode: int = 0o600) -> None:
        """Write a temp file beside ``path`` (mode set before any data), then rename over it."""
        self.rename(self.write_temp(path, text, mode), path)

    def remove(self, path: str) -> bool:
        try:
            self.sftp.remove(path)
            return True
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------ the ~/.ssh lock

    @contextlib.contextmanager
    def locked(self, directory: str = ".ssh") -> Iterator[None]:
        """Hold ``flock`` on ``directory`` on the node while the body runs: one more channel on
        this connection (not a login) runs ``flock DIR`` around a process that waits for us to
        say we are done. The node lets go by itself if we vanish (EOF) or after the phase's
        time (``timeout``), so a dropped link never leaves the lock held."""
        hold = max(1, int(self.remaining()) + 1)
        command = (
            f"exec flock -w {hold} {shlex.quote(directory)} "
            f"sh -c 'echo locked; exec timeout {hold} head -c 1 >/dev/null'"
        )
        channel = self.conn.transport.open_session(timeout=self.remaining())
        try:
            channel.settimeout(self.remaining())
            channel.exec_command(command)
            got = b""
            while b"\n" not in got:
                chunk = channel.recv(64)
                if not chunk:
                    err = channel.recv_stderr(500).decode(errors="replace").strip()
                    raise MeshkitError(
                        f"could not lock ~/{directory} (flock): {err or 'no answer'}; "
                        "is another meshkit run holding it, or is flock (util-linux) missing?"
                    )
                got += chunk
            if not got.startswith(b"locked"):
                raise MeshkitError(f"could not lock ~/{directory}: {got[:100]!r}")
            yield
        finally:
            with contextlib.suppress(Exception):
                channel.shutdown_write()  # head sees EOF: the lock is released
                channel.close()

    def close(self) -> None:
        if self._sftp is not None:
            with contextlib.suppress(Exception):
                self._sftp.close()
        self.conn.close()
