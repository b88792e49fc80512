"""The job file, the tmux argv and wrapper script, and the node-side helpers (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from meshkit import job as jobs
from meshkit import node, tmux
from meshkit.errors import JobError
from meshkit.job import Job

HOSTILE = """echo "it's $NODE_RANK"; echo `date` $(whoami) && exit 3 # ; rm -rf /"""


def make_job(**kw: object) -> Job:
    base = dict(
        cmd=HOSTILE,
        workdir="/shared/w d",
        session="s1",
        hostfile="/shared/hostfile",
        python="/venv/bin/python",
        master_port=25000,
        nproc_per_node=2,
        env={"A": "x y"},
        setup=("source /venv/bin/activate",),
    )
    return Job(**{**base, **kw})  # type: ignore[arg-type]


def test_job_round_trips_and_rejects_bad_files():
    job = make_job()
    assert jobs.from_json(job.to_json(), "f") == job
    assert str(jobs.job_file("/shared/w d", "s1")) == "/shared/w d/.meshkit/s1/job.json"
    assert job.log(3) == "/shared/w d/.meshkit/s1/node3.log"
    with pytest.raises(JobError, match="not a meshkit job file"):
        jobs.from_json('{"cmd": 1}', "f")
    for bad in ("", "a b", "x;y", "../up", "a" * 65):
        with pytest.raises(JobError, match="session name"):
            jobs.check_session(bad)


def test_wrapper_script_carries_the_command_verbatim_through_bash():
    job = make_job()
    argv = tmux.new_session(job)
    assert argv[:8] == ["tmux", "new-session", "-d", "-s", "s1", "-c", "/shared/w d", "bash"]
    script = argv[-1]
    # the command is one argument of `meshkit run --cmd`, exactly as given
    run_line = next(line for line in script.splitlines() if " -m meshkit run " in line)
    import shlex

    words = shlex.split(run_line)
    assert words[words.index("--cmd") + 1] == HOSTILE
    assert words[words.index("--log") + 1] == "/shared/w d/.meshkit/s1/node{rank}.log"
    assert "export MESHKIT_SESSION=s1" in script and "export A='x y'" in script
    # and the whole tmux argv survives a remote shell
    assert shlex.split(tmux.command(argv)) == argv


def test_node_stop_ends_every_tagged_process_and_only_those():
    session = f"t{os.getpid()}"
    env = {**os.environ, "MESHKIT_SESSION": session}
    tagged = subprocess.Popen(
        ["bash", "-c", "sleep 300 & sleep 300 & wait"], env=env, start_new_session=True
    )
    other = subprocess.Popen(["sleep", "300"])
    try:
        deadline = time.monotonic() + 10
        while len(node.job_pids(session)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(node.job_pids(session)) == 3  # bash and both sleeps, found by their tag
        result = node.stop(session, "/nonexistent-state")
        assert result["left"] == [] and result["signalled"] == 3
        assert node.job_pids(session) == []
        assert other.poll() is None
    finally:
        for p in (tagged, other):
            p.kill()
            p.wait()


def test_node_status_and_port_probe(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    log = tmp_path / "node0.log"
    assert node.status("nosuch-session", str(log), str(state))["state"] == "absent"
    (state / "exit").write_text("7\n")
    (state / "started").write_text("1700000000\n")
    log.write_text("first\nlast words\n\n")
    got = node.status("nosuch-session", str(log), str(state))
    assert got == {
        "state": "exited",
        "exit_code": 7,
        "started": 1700000000,
        "last_line": "last words",
    }
    out = subprocess.run(
        [sys.executable, "-m", "meshkit.node", "port-free", "s", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["ports"][0]["port"] == 1 and data["ours"] is False


def test_node_agent_answers_json_requests_and_survives_bad_ones(tmp_path):
    import io

    requests = io.StringIO(
        json.dumps({"op": "port-free", "args": {"session": "s", "ports": [1]}})
        + "\n"
        + json.dumps({"op": "nosuch", "args": {}})
        + "\n"
        + json.dumps({"op": "env", "args": {"cwd": str(tmp_path / "missing"), "argv": ["x"]}})
        + "\n"
        + json.dumps(
            {"op": "env", "args": {"cwd": str(tmp_path), "argv": ["/nonexistent/python3"]}}
        )
        + "\n"
    )
    replies = io.StringIO()
    node.serve(requests, replies)
    got = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert got[0]["ok"] and got[0]["result"]["ports"][0]["port"] == 1
    assert not got[1]["ok"] and "nosuch" in got[1]["error"]
    assert got[2]["result"]["err"].startswith("cd: ") and got[3]["result"]["code"] == 127
