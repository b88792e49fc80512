"""Warm start: a command run through this user's warm server behaves as it does inline (output,
exit code, directory, environment, Ctrl-C), the server serves only what it may, and it ends.

The end-to-end tests need no root: a loopback listener that never speaks SSH makes a node that
takes ``connect_timeout`` to fail, which is long enough to see the server's child run it. Each
test's server gets a socket of its own through the key's ``PYTHON*`` variables."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import MESHKIT, fresh_sandbox, meshkit

from meshkit.cli import warm
from meshkit.cli.warmserver import BadRequest, parse


def request(**change: object) -> bytes:
    import marshal

    base: dict[str, object] = {
        "argv": ["status"],
        "cwd": "/",
        "env": {"A": "b"},
        "umask": 0o022,
        "path0": "/",
        "streams": [("utf-8", "strict", False)] * 3,
    }
    return marshal.dumps({**base, **change})


def test_a_request_is_checked_field_by_field() -> None:
    assert parse(request()).argv == ["status"]
    for bad in (
        {"argv": ["env"]},  # the node side's fast path: never through the server
        {"argv": ["sandbox.up"]},
        {"argv": ["mesh", "--password"]},
        {"argv": []},
        {"argv": "status"},
        {"cwd": 3},
        {"env": {"A": 1}},
        {"umask": 0o1777},
        {"streams": [("utf-8", "strict", False)] * 2},
    ):
        with pytest.raises(BadRequest):
            parse(request(**bad))
    for junk in (b"", b"\x00garbage", b"x" * 10):
        with pytest.raises(BadRequest):
            parse(junk)


def test_only_node_facing_tasks_go_warm_and_off_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHKIT_WARM_START", raising=False)
    assert warm.eligible(["train", "--cmd", "x"]) and warm.eligible(["status"])
    assert not warm.eligible(["env"]) and not warm.eligible(["run", "--cmd", "x"])
    assert not warm.eligible(["supervise"]) and not warm.eligible(["sandbox.up"])
    assert not warm.eligible(["mesh", "--password"]) and warm.eligible(["mesh"])
    monkeypatch.setenv("MESHKIT_WARM_START", "off")
    assert not warm.eligible(["status"])


def test_a_socket_directory_is_trusted_only_when_private_and_ours(tmp_path: Path) -> None:
    parent = tmp_path / "rt"
    parent.mkdir(mode=0o700)
    leaf = parent / "warm"
    leaf.mkdir(mode=0o700)
    assert warm.private_dir(str(leaf))
    leaf.chmod(0o755)
    assert not warm.private_dir(str(leaf))
    leaf.chmod(0o700)
    parent.chmod(0o777)
    assert not warm.private_dir(str(leaf))
    parent.chmod(0o700)
    link = parent / "link"
    link.symlink_to(leaf)
    assert not warm.private_dir(str(link))


# ---- end to end, no root -------------------------------------------------------------------


@pytest.fixture
def silent_node() -> Iterator[int]:
    """A loopback port that accepts TCP and never sends an SSH banner."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def hold() -> None:
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


class Warm:
    """One test's own server: its socket (through a PYTHON* variable in the key) and its end."""

    def __init__(self, idle: str = "60") -> None:
        self.env = {
            **os.environ,
            "MESHKIT_WARM_START": idle,
            "PYTHONMESHKITWARMTEST": uuid.uuid4().hex,
        }
        self.path = subprocess.run(
            [sys.executable, "-c", "from meshkit.cli import warm; print(warm.socket_path())"],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        ).stdout.strip()

    def pid(self) -> int | None:
        try:
            return int(Path(self.path + ".pid").read_text())
        except (OSError, ValueError):
            return None

    def wait_up(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pid = self.pid()
            if pid and os.path.exists(self.path):
                return pid
            time.sleep(0.05)
        raise AssertionError("no warm server came up")

    def children(self, pid: int) -> list[int]:
        try:
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def serving(self, server: int, client: int) -> bool:
        """The server has a child writing to the client's own stdout (the very pipe)."""
        try:
            mine = os.readlink(f"/proc/{client}/fd/1")
        except OSError:
            return False
        for child in self.children(server):
            try:
                if os.readlink(f"/proc/{child}/fd/1") == mine:
                    return True
            except OSError:
                continue
        return False

    def end(self) -> None:
        pid = self.pid()
        if pid and Path(f"/proc/{pid}/cmdline").exists():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"meshkit.cli.warmserver" in cmdline:  # ours (a pid file can outlive its pid)
                os.kill(pid, signal.SIGTERM)
        for suffix in ("", ".pid", ".lock"):
            Path(self.path + suffix).unlink(missing_ok=True)


@pytest.fixture
def warmed() -> Iterator[Warm]:
    server = Warm()
    try:
        yield server
    finally:
        server.end()


def numbers_out(text: str) -> str:
    """Timings, and which of paramiko's two timeouts on a silent node fired first (a race
    inline as much as warm: the banner's and the connection's are both connect_timeout)."""
    text = re.sub(r"SSHException: .*", "SSHException: ...", text)
    return re.sub(r"\d+\.\d+s", "Ns", text)


def test_a_warm_command_is_the_inline_command(
    tmp_path: Path, silent_node: int, warmed: Warm
) -> None:
    """Same output, exit code, working directory (a relative hostfile, a meshkit.yaml there)
    and environment (MESHKIT_* variables); and it really ran in the server's child."""
    (tmp_path / "nodes").write_text("127.0.0.1\n")
    (tmp_path / "meshkit.yaml").write_text("hostfile: nodes\n")
    env = {**warmed.env, "MESHKIT_PORT": str(silent_node), "MESHKIT_CONNECT_TIMEOUT": "2"}
    argv = [*MESHKIT, "check"]

    def run(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True, timeout=60
        )

    inline = run({"MESHKIT_WARM_START": "off"})
    assert inline.returncode == 1 and "127.0.0.1" in inline.stdout, inline
    first = run({})  # no server yet: inline, and it starts one for the next command
    server = warmed.wait_up()
    child = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 10
    seen = False
    while not seen and time.monotonic() < deadline:
        seen = warmed.serving(server, child.pid)
        time.sleep(0.02)
    out, err = child.communicate(timeout=60)
    assert seen, "the warm server never ran the command"
    for done in (first, subprocess.CompletedProcess(argv, child.returncode, out, err)):
        assert done.returncode == inline.returncode
        assert numbers_out(done.stdout) == numbers_out(inline.stdout)
        assert numbers_out(done.stderr) == numbers_out(inline.stderr)


def test_ctrl_c_reaches_the_warm_command_and_ends_it(
    tmp_path: Path, silent_node: int, warmed: Warm
) -> None:
    (tmp_path / "hostfile").write_text("127.0.0.1\n")
    env = {**warmed.env, "MESHKIT_PORT": str(silent_node), "MESHKIT_CONNECT_TIMEOUT": "30"}
    subprocess.run([*MESHKIT, "status"], cwd=tmp_path, env=env, capture_output=True, timeout=60)
    server = warmed.wait_up()
    client = subprocess.Popen(
        [*MESHKIT, "check"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not warmed.serving(server, client.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert warmed.serving(server, client.pid), "the warm server never ran the command"
    client.send_signal(signal.SIGINT)
    out, err = client.communicate(timeout=10)  # one Ctrl-C, not the 30 s connect timeout
    assert client.returncode == 130, (err, out)
    assert "interrupted" in err and "Traceback" not in err
    deadline = time.monotonic() + 5
    while warmed.children(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not warmed.children(server)


def test_an_idle_server_ends_and_takes_its_socket_along(tmp_path: Path) -> None:
    server = Warm(idle="1")
    try:
        (tmp_path / "hostfile").write_text("127.0.0.1\n")
        subprocess.run(
            [*MESHKIT, "status"], cwd=tmp_path, env=server.env, capture_output=True, timeout=60
        )
        pid = server.wait_up()
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists()
        assert not os.path.exists(server.path) and not os.path.exists(server.path + ".pid")
    finally:
        server.end()


def test_a_file_that_turns_warm_start_off_ends_the_server(tmp_path: Path) -> None:
    """A server serves commands configured for warm start: one whose configuration has none (a
    meshkit.yaml with ``warm_start: off`` here) still runs (in it, as inline), and then the
    server takes no more commands and ends."""
    server = Warm()
    try:
        (tmp_path / "hostfile").write_text("127.0.0.1\n")
        argv = [*MESHKIT, "status"]
        started = subprocess.run(
            argv, cwd=tmp_path, env=server.env, capture_output=True, timeout=60
        )
        pid = server.wait_up()
        (tmp_path / "meshkit.yaml").write_text("warm_start: off\n")
        env = {k: v for k, v in server.env.items() if k != "MESHKIT_WARM_START"}
        served = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=60)
        assert (served.returncode, served.stderr) == (started.returncode, started.stderr)
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists()
        assert not os.path.exists(server.path)
        again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, timeout=60)
        assert again.returncode == started.returncode
        time.sleep(0.5)
        assert server.pid() is None and not os.path.exists(server.path), "it started a server"
    finally:
        server.end()


# ---- on real nodes ---------------------------------------------------------------------------


def test_train_status_logs_stop_through_the_warm_server_from_elsewhere(tmp_path: Path) -> None:
    server = Warm()
    with fresh_sandbox("twarm", 2) as lay:
        try:
            hf = str(lay.hostfile)
            assert meshkit("mesh", "--hostfile", hf, "--no-verify").returncode == 0
            work = lay.shared / "warmjob"
            work.mkdir()
            env = {k: v for k, v in server.env.items() if k != "MESHKIT_WARM_START"}
            on = {"MESHKIT_WARM_START": "60"}
            # Inline (it starts the server), then from / through it.
            started = meshkit(
                "train", "--hostfile", hf, "--cmd", "echo warm-$NODE_RANK; sleep 60",
                cwd=work, env={**env, **on},
            )  # fmt: skip
            assert started.returncode == 0, started.stderr
            server.wait_up()
            where = ["--hostfile", hf, "--workdir", str(work)]
            warm_status = meshkit("status", "--json", *where, cwd="/", env={**env, **on})
            cold_status = meshkit(
                "status", "--json", *where, cwd="/", env={**env, "MESHKIT_WARM_START": "off"}
            )
            assert warm_status.returncode == cold_status.returncode == 0, warm_status.stderr
            states = [r["state"] for r in json.loads(warm_status.stdout)]
            assert states == [r["state"] for r in json.loads(cold_status.stdout)] == ["running"] * 2
            deadline = time.monotonic() + 20
            logs = ""
            while "warm-1" not in logs and time.monotonic() < deadline:
                logs = meshkit("logs", *where, cwd="/", env={**env, **on}).stdout
            assert "warm-0" in logs and "warm-1" in logs
            stopped = meshkit("stop", *where, cwd="/", env={**env, **on})
            assert stopped.returncode == 0, stopped.stderr
            after = meshkit("status", "--json", *where, cwd="/", env={**env, **on})
            assert [r["state"] for r in json.loads(after.stdout)] != ["running"] * 2
        finally:
            server.end()
