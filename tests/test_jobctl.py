"""Sandbox: the job tasks end to end, as users run them, on real sshd nodes with real tmux.

From another node's home directory, two projects side by side, detached processes, a missing
interpreter, paths with tmux format characters, and Ctrl-C. The node side alone is test_jobs, the
controller's jobs ops against canned node replies test_ops_jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MESHKIT, meshkit
from helpers.sandbox_jobs import inside, wait_for

from meshkit import sandbox

SANDBOX_NODES = 3


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    return cluster


def project(lay, name: str) -> Path:
    work = lay.shared / name
    work.mkdir(parents=True, exist_ok=True)
    return work


def states(lay, index: int, cwd: str, *where: str) -> list[str]:
    out = inside(lay, index, cwd, "status", "--json", *where)
    assert out.returncode in (0, 1), out.stderr
    return [row["state"] for row in json.loads(out.stdout)]


def test_status_logs_stop_and_relaunch_from_another_nodes_home(meshed):
    lay = meshed
    work = project(lay, "proj")
    hf = str(lay.hostfile)
    cmd = 'echo "hello from $NODE_RANK"; sleep 300'
    out = inside(lay, 0, str(work), "train", "--hostfile", hf, "--session", "far", "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    where = ("--hostfile", hf, "--session", "far")
    # node2, in root's home: nothing but the hostfile and the session name
    assert wait_for(
        lambda: states(lay, 2, "/root", *where) == ["running"] * 3, timeout=60, interval=0.3
    )
    logs = inside(lay, 2, "/root", "logs", *where, "--lines", "5")
    assert logs.returncode == 0, logs.stderr
    assert {f"[{r}] hello from {r}" for r in range(3)} <= set(logs.stdout.splitlines())
    stop = inside(lay, 2, "/root", "stop", *where)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert stop.stdout.count("nothing left") == 3, stop.stdout + stop.stderr
    assert states(lay, 1, "/tmp", *where) == ["absent"] * 3
    again = inside(lay, 1, "/root", "train", *where)  # a bare relaunch, from a third place
    assert again.returncode == 0, again.stdout + again.stderr
    assert wait_for(
        lambda: states(lay, 0, "/", *where) == ["running"] * 3, timeout=60, interval=0.3
    )
    assert inside(lay, 0, "/", "stop", *where).returncode == 0
    # nothing found: the error says where it looked
    missing = inside(lay, 2, "/root", "status", "--hostfile", hf, "--session", "nosuch")
    assert missing.returncode == 1
    assert "looked in" in missing.stderr
    assert f"{lay.root}/.meshkit/jobs/hostfile--nosuch.json" in missing.stderr


def test_two_projects_with_the_default_session_never_end_each_other(meshed):
    lay = meshed
    alpha = project(lay, "alpha")
    beta = project(lay, "beta")
    hf = str(lay.hostfile)
    started = inside(lay, 0, str(alpha), "train", "--hostfile", hf, "--cmd", "sleep 300")
    assert started.returncode == 0
    refused = inside(lay, 1, str(beta), "train", "--hostfile", hf, "--cmd", "sleep 300")
    assert refused.returncode == 1
    assert "another meshkit job is running there" in refused.stderr
    assert f"'meshkit' in {alpha}" in refused.stderr
    assert "--replace" in refused.stderr
    assert states(lay, 0, str(alpha), "--hostfile", hf) == ["running"] * 3  # untouched
    taken = inside(lay, 1, str(beta), "train", "--hostfile", hf, "--cmd", "sleep 300", "--replace")
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert "alpha" in taken.stdout  # the table names what it replaced
    assert states(lay, 0, str(alpha), "--workdir", str(alpha)) == ["absent"] * 3
    assert states(lay, 0, str(beta), "--workdir", str(beta)) == ["running"] * 3
    assert inside(lay, 0, str(beta), "stop", "--workdir", str(beta)).returncode == 0


def test_stop_finds_setsid_env_i_processes_and_says_so_only_after_looking(meshed):
    lay = meshed
    work = project(lay, "detach")
    cmd = "setsid env -i sleep 301 & setsid nohup sleep 302 >/dev/null 2>&1 & sleep 300"
    hf = str(lay.hostfile)
    assert inside(lay, 0, str(work), "train", "--hostfile", hf, "--cmd", cmd).returncode == 0

    def sleeping(index: int) -> list[str]:
        found = sandbox.node_exec(lay.nodes[index], ["pgrep", "-a", "-x", "sleep"])
        return [ln for ln in found.stdout.splitlines() if ln.endswith(("sleep 301", "sleep 302"))]

    assert wait_for(lambda: all(len(sleeping(i)) == 2 for i in range(3)), timeout=60, interval=0.3)
    out = inside(lay, 2, str(work), "stop")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("nothing left") == 3, out.stdout + out.stderr
    assert all(sleeping(i) == [] for i in range(3))


def test_stop_with_a_missing_interpreter_is_a_row_per_node_not_a_traceback(meshed):
    lay = meshed
    work = project(lay, "nopython")
    hf = str(lay.hostfile)
    assert (
        inside(lay, 0, str(work), "train", "--hostfile", hf, "--cmd", "sleep 300").returncode == 0
    )
    saved = work / ".meshkit" / "meshkit" / "job.json"
    original = saved.read_text()
    data = json.loads(original)
    data["python"] = "/nonexistent/python3"
    saved.write_text(json.dumps(data))
    try:
        out = inside(lay, 1, str(work), "stop")
    finally:
        saved.write_text(original)
        restored = inside(lay, 1, str(work), "stop")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stdout.count("FAILED: interpreter /nonexistent/python3 not found") == 3, out.stdout
    assert restored.returncode == 0, restored.stdout + restored.stderr


def test_paths_with_tmux_format_characters_are_only_paths(meshed):
    lay = meshed
    work = project(lay, "exp#S{r}#(touch pwned)")
    hf = str(lay.hostfile)
    cmd = 'pwd > "where$NODE_RANK"; echo done'
    out = inside(lay, 0, str(work), "train", "--hostfile", hf, "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    assert wait_for(lambda: states(lay, 1, str(work)) == ["exited"] * 3, timeout=60, interval=0.3)
    assert all((work / f"where{r}").read_text().strip() == str(work) for r in range(3))
    assert not list(lay.shared.rglob("pwned"))
    assert not Path("/root/pwned").exists()
    logs = inside(lay, 1, str(work), "logs")
    assert logs.returncode == 0, logs.stdout + logs.stderr
    assert logs.stdout.count("done") == 3, logs.stdout + logs.stderr


def test_a_session_name_tmux_would_rename_is_refused(meshed):
    out = inside(
        meshed,
        0,
        "/root",
        "train",
        "--hostfile",
        str(meshed.hostfile),
        "--session",
        "my.job",
        "--cmd",
        "true",
    )
    assert out.returncode == 2
    assert "session name 'my.job'" in out.stderr


def test_one_ctrl_c_ends_follow_promptly(meshed):
    lay = meshed
    work = project(lay, "follow")
    hf = str(lay.hostfile)
    assert (
        inside(
            lay,
            0,
            str(work),
            "train",
            "--hostfile",
            hf,
            "--cmd",
            "while true; do echo tick; sleep 0.2; done",
        ).returncode
        == 0
    )
    follow = subprocess.Popen(
        [*MESHKIT, "logs", "--hostfile", hf, "--workdir", str(work), "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert follow.stdout is not None
        wait_for(lambda: "tick" in follow.stdout.readline(), timeout=30, interval=0)
        follow.send_signal(signal.SIGINT)
        code = follow.wait(timeout=10)  # one Ctrl-C is enough (it used to take two)
    finally:
        follow.kill()
    assert code == 130, code
    assert inside(lay, 0, str(work), "stop").returncode == 0


def test_one_ctrl_c_ends_a_command_stuck_on_a_hung_node(meshed):
    """A node whose sshd accepts TCP but never answers (SIGSTOP): the connect phase hangs until
    connect_timeout; one Ctrl-C must end the command at once, exit 130, no traceback."""
    lay = meshed
    work = project(lay, "hung")  # a directory with no meshkit.yaml
    node = lay.nodes[2]
    sshd = [
        p
        for p in sandbox.netns_pids(node.netns)
        if os.path.realpath(f"/proc/{p}/exe") == os.path.realpath(sandbox.SSHD)
    ]
    os.kill(min(sshd), signal.SIGSTOP)
    try:
        hung = subprocess.Popen(
            [*MESHKIT, "check", "--hostfile", str(lay.hostfile)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(work),
            env={**os.environ, "MESHKIT_CONNECT_TIMEOUT": "120"},
        )
        time.sleep(3)
        assert hung.poll() is None  # still waiting for node2
        hung.send_signal(signal.SIGINT)
        code = hung.wait(timeout=10)
        err = hung.stderr.read() if hung.stderr else ""
    finally:
        os.kill(min(sshd), signal.SIGCONT)
    assert code == 130, err
    assert "interrupted" in err, err
    assert "Traceback" not in err, err


def test_each_agent_starts_as_its_node_connects_and_serves_every_later_phase(meshed):
    """``AgentPool.connect`` starts each node's agent inside the connect phase, as soon as that
    node's connection is up (no phase of its own): before any request, every node already runs
    one; later phases reuse it rather than start another."""
    from meshkit.discovery import read_hosts
    from meshkit.outcome import PhaseEvent
    from meshkit.protocol import JobsReply, JobsRequest
    from meshkit.remote import AgentPool, Settings

    lay = meshed
    hosts = read_hosts(lay.hostfile)
    settings = Settings(connect_timeout=5.0, ssh_configs=(str(lay.ssh_config),))
    events: list[PhaseEvent] = []

    def agents_on(node: sandbox.Node) -> int:
        out = sandbox.node_exec(node, ["ps", "-eo", "args"], timeout=30).stdout
        return sum("meshkit.node serve" in line for line in out.splitlines())

    with AgentPool.connect(hosts, settings, sys.executable, events.append) as pool:
        assert [e.phase for e in events if e.finished] == ["connect"]
        wait_for(lambda: all(agents_on(n) == 1 for n in lay.nodes), timeout=20, interval=0.3)
        first = pool.call_all("jobs", lambda h: JobsRequest(), JobsReply)
        second = pool.call_all("jobs", lambda h: JobsRequest(), JobsReply)
        assert list(first) == list(second) == hosts
        assert all(o.ok for o in [*first.values(), *second.values()])
        assert all(agents_on(n) == 1 for n in lay.nodes)
    wait_for(lambda: all(agents_on(n) == 0 for n in lay.nodes), timeout=20, interval=0.3)
