"""Node-side helpers that the controller runs over SSH (``python -m meshkit.node OP ...``), each
printing one JSON object. Standard library only: they run on every node at every status/stop."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

SESSION_TAG = "MESHKIT_SESSION"
TERM_GRACE = 5.0
KILL_GRACE = 2.0


def job_pids(session: str) -> list[int]:
    """Every process of this machine carrying the job's tag (tmux pane, meshkit run, torchrun,
    its workers, whatever they started), except ourselves."""
    tag = f"{SESSION_TAG}={session}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if tag in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def tmux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10, check=False)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(session: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := job_pids(session)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def stop(session: str, state_dir: str) -> dict[str, object]:
    """End the tmux session, then TERM (and after a grace period KILL) every tagged process; then
    forget the run's state, so a stopped job reads ``absent`` on every node alike."""
    had_session = tmux("has-session", "-t", f"={session}").returncode == 0
    tmux("kill-session", "-t", f"={session}")
    pids = job_pids(session)
    _signal_all(pids, signal.SIGTERM)
    left = _wait_gone(session, TERM_GRACE)
    if left:
        _signal_all(left, signal.SIGKILL)
        left = _wait_gone(session, KILL_GRACE)
    if not left:
        for name in ("exit", "started"):
            with contextlib.suppress(OSError):
                (Path(state_dir) / name).unlink()
    return {"session": had_session, "signalled": len(pids), "left": left}


def start(session: str, state_dir: str, argv: list[str]) -> dict[str, object]:
    """Replace the job's session in one call: stop the old one (whole tree), start the new one,
    and say whether it is running."""
    old = stop(session, state_dir)
    if old["left"]:
        return {"started": False, "error": f"processes of the old session survived: {old['left']}"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return {"started": False, "error": done.stderr.strip()[-300:] or f"exit {done.returncode}"}
    running = tmux("has-session", "-t", f"={session}").returncode == 0
    return {
        "started": True,
        "running": running,
        "replaced": bool(old["session"]) or bool(old["signalled"]),
    }


def status(session: str, log: str, state_dir: str) -> dict[str, object]:
    running = tmux("has-session", "-t", f"={session}").returncode == 0
    state = Path(state_dir)
    exit_code = _read_int(state / "exit")
    started = _read_int(state / "started")
    if running and exit_code is None:
        kind = "running"
    elif exit_code is not None:
        kind = "exited"
    else:
        kind = "absent"
    return {
        "state": kind,
        "exit_code": exit_code,
        "started": started,
        "last_line": _last_line(Path(log)),
    }


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _last_line(path: Path, window: int = 8192) -> str | None:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - window))
            lines = [ln for ln in handle.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][-300:] if lines else None


def port_free(port: int) -> dict[str, object]:
    """Whether a TCP listener could bind ``port`` here (as torchrun's store will)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((addr, port))
            return {"port": port, "free": True}
        except OSError as exc:
            if exc.errno == 98:  # EADDRINUSE
                return {"port": port, "free": False}
    return {"port": port, "free": True}


def run_env(cwd: str, argv: list[str]) -> dict[str, object]:
    """``meshkit env --json ...`` in the job's workdir, as a login there would run it."""
    if not Path(cwd).is_dir():
        return {"code": 1, "out": "", "err": f"cd: {cwd}: No such file or directory"}
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=60, check=False
        )
    except FileNotFoundError:
        return {"code": 127, "out": "", "err": f"{argv[0]}: No such file or directory"}
    return {"code": done.returncode, "out": done.stdout, "err": done.stderr}


def probe_ports(session: str, ports: list[int]) -> dict[str, object]:
    return {"ports": [port_free(p) for p in ports], "ours": bool(job_pids(session))}


OPS: dict[str, Callable[..., object]] = {
    "env": run_env,
    "port-free": probe_ports,
    "start": start,
    "stop": stop,
    "status": status,
}


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer one JSON request per line (``{"op": ..., "args": {...}}``) until stdin closes: the
    controller's one exec channel per node for a whole launch (data arrives as JSON, never shell)."""
    for line in requests:
        try:
            request = json.loads(line)
            reply = {"ok": True, "result": OPS[request["op"]](**request["args"])}
        except Exception as exc:  # one request failed; say so and keep serving
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshkit.node")
    sub = parser.add_subparsers(dest="op", required=True)
    s = sub.add_parser("status")
    s.add_argument("session")
    s.add_argument("log")
    s.add_argument("state_dir")
    st = sub.add_parser("stop")
    st.add_argument("session")
    st.add_argument("state_dir")
    go = sub.add_parser("start")
    go.add_argument("session")
    go.add_argument("state_dir")
    go.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("serve")
    p = sub.add_parser("port-free")
    p.add_argument("session")
    p.add_argument("ports", type=int, nargs="+")
    args = parser.parse_args(argv)
    if args.op == "serve":
        serve(sys.stdin, sys.stdout)
        return
    if args.op == "status":
        result: object = status(args.session, args.log, args.state_dir)
    elif args.op == "stop":
        result = stop(args.session, args.state_dir)
    elif args.op == "start":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        result = start(args.session, args.state_dir, argv)
    else:
        result = probe_ports(args.session, args.ports)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
