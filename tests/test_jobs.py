"""Node side, on this machine: a job's records, the agent and the keeper, real tmux, no SSH.

The job model, the protocol, and the node side (agent, keeper, stop) with real processes and a
real (private) tmux server on this machine. The controller's jobs ops are test_ops_jobs (canned
node replies), the job tasks end to end test_jobctl (sandbox)."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshkit import job as jobs
from meshkit import protocol
from meshkit.errors import JobError, UsageError
from meshkit.job import Job
from meshkit.node import agent, files, procs, rankenv, tmux
from meshkit.node import jobs as node_jobs
from meshkit.ops.lookup import find_job

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
    assert str(job.file) == "/shared/w d/.meshkit/s1/job.json"
    assert job.log(3) == "/shared/w d/.meshkit/s1/node3.log"
    assert str(job.index) == "/shared/.meshkit/jobs/hostfile--s1.json"
    with pytest.raises(JobError, match="not a meshkit job file"):
        jobs.from_json('{"cmd": 1}', "f")
    with pytest.raises(JobError, match="not a meshkit job file"):
        jobs.from_json(make_job().to_json().replace('"s1"', '"a.b"'), "f")


def test_job_keeps_its_policy_and_marks_later_attempts():
    job = Job("torchrun t.py", "/w", "s", "/h", "/p", 1, restarts=2, restart_on=(1,), sync=True)
    again = jobs.from_json(job.to_json(), "job.json")
    assert again == job
    assert again.node_hostfile == "/w/.meshkit/s/hostfile"
    assert job.node_job(1).argv[-1] == "torchrun t.py"
    assert job.node_job(2).argv[-1] == "echo '===== meshkit: attempt 2 of 3 ====='\ntorchrun t.py"
    assert jobs.parse_restart_on("137, 1") == (1, 137)
    assert jobs.parse_restart_on(None) == ()
    with pytest.raises(UsageError, match="not an exit code"):
        jobs.parse_restart_on("1,x")


def test_the_supervisor_logs_and_the_copies_of_the_jobs_home_are_named_once():
    job = make_job()
    assert job.supervisor_log(2) == "/shared/w d/.meshkit/s1/supervisor-node2.log"
    assert job.supervisor_logs == "/shared/w d/.meshkit/s1/supervisor-node{rank}.log"
    hosts = ["master", "node1", "node2"]
    assert job.home_copies(hosts) == ["master"]  # type: ignore[arg-type]
    synced = make_job(sync=True)
    assert synced.home_copies(hosts) == hosts  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "a b", "x;y", "../up", "a" * 65, "my.job", "a:b"])
def test_session_names_follow_tmux_rules(bad):
    with pytest.raises(UsageError, match="session name"):
        jobs.check_session(bad)


def test_identity_includes_the_workdir_and_paths_never_meet_a_format_language():
    a = make_job(workdir="/p/one")
    b = make_job(workdir="/p/two")
    assert a.id != b.id
    assert a.tmux_session != b.tmux_session  # same session, two projects
    odd = make_job(workdir="/x/exp#S{r}#(touch /tmp/pwn)")
    assert odd.log(2) == "/x/exp#S{r}#(touch /tmp/pwn)/.meshkit/s1/node2.log"
    assert "#" not in odd.tmux_session
    assert "{" not in odd.tmux_session


def test_node_job_carries_the_command_verbatim():
    spec = make_job().node_job()
    assert spec.argv[spec.argv.index("--cmd") + 1] == HOSTILE
    assert spec.argv[spec.argv.index("--log") + 1] == "/shared/w d/.meshkit/s1/node{rank}.log"
    # the job's environment, and what every rank learns of its attempt (the first: a start)
    assert spec.env == {"A": "x y"} | jobs.restart_env(1, "start", 1, "")
    assert spec.setup == ["source /venv/bin/activate"]


@pytest.mark.parametrize("name", ["A;B", "1X", "A B", "$(x)", ""])
def test_env_names_must_be_variable_names(name):
    with pytest.raises(UsageError, match="not a variable name"):
        jobs.check_env({name: "v"})


def test_find_job_by_workdir_index_or_cwd_and_says_where_it_looked():
    job = make_job(workdir="/proj", hostfile="/shared/hostfile")
    files = {str(job.file): job.to_json(), str(job.index): job.index_json()}
    found = find_job("s1", workdir=None, hostfile="/shared/hostfile", cwd="/home/u", read=files.get)
    assert found == job  # through the index beside the hostfile, from another directory
    assert find_job("s1", workdir="/proj", hostfile=None, cwd="/", read=files.get) == job
    with pytest.raises(JobError) as info:
        find_job("s1", workdir=None, hostfile="/other/hf", cwd="/home/u", read=files.get)
    text = str(info.value)
    assert "/other/.meshkit/jobs/hf--s1.json" in text
    assert "/home/u/.meshkit/s1/job.json" in text


def test_protocol_round_trips_and_rejects_malformed_lines():
    request = protocol.StartRequest(make_job().node_job(), replace=True)
    op, back = protocol.decode_request(protocol.encode_request(request))
    assert op == "start"
    assert back == request
    reply = protocol.StatusReply("exited", 7, 1.5, "last")
    assert protocol.decode_reply("status", protocol.encode_reply(reply)) == reply
    version = protocol.VERSION
    for bad in (
        json.dumps({"v": version, "op": "status", "args": {"job_id": 5, "log": "x"}}),
        json.dumps({"v": version, "op": "rm", "args": {}}),
        json.dumps({"v": version + 1, "op": "jobs", "args": {}}),
        "[1]",
        "not json",
    ):
        with pytest.raises(protocol.ProtocolViolation):
            protocol.decode_request(bad)
    with pytest.raises(protocol.NodeFailure, match="boom"):
        protocol.decode_reply("status", protocol.encode_reply(None, "boom"))
    with pytest.raises(protocol.ProtocolViolation):
        protocol.decode_reply("status", '{"ok": true, "result": {"state": 1}}')


def test_agent_answers_and_survives_bad_requests(tmp_path):
    lines = [
        protocol.encode_request(protocol.PortsRequest("0" * 16, [1])),
        json.dumps({"v": protocol.VERSION, "op": "nosuch", "args": {}}) + "\n",
        protocol.encode_request(protocol.EnvRequest(str(tmp_path / "missing"), "hostfile", "s", 1)),
        protocol.encode_request(protocol.EnvRequest(str(tmp_path), "no-such-hostfile", "s", 1)),
        "x" * (protocol.MAX_LINE + 10) + "\n",
        protocol.encode_request(protocol.JobsRequest()),
    ]
    replies = io.StringIO()
    agent.serve(io.StringIO("".join(lines)), replies)
    got = [json.loads(line) for line in replies.getvalue().splitlines()]
    assert got[0]["ok"]
    assert got[0]["result"]["ports"][0]["port"] == 1
    assert not got[1]["ok"]
    assert "nosuch" in got[1]["error"]
    assert "workdir" in got[2]["result"]["error"]
    assert "missing" in got[2]["result"]["error"]
    assert "no such hostfile" in got[3]["result"]["error"]
    assert got[3]["result"]["variables"] == {}
    assert not got[4]["ok"]
    assert "longer than" in got[4]["error"]
    assert got[-1]["ok"]  # still serving after all of that


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e300", "-1e12", "NaN\n"])
def test_a_started_file_holding_no_time_is_the_nodes_problem_never_sent(
    text, tmp_path, monkeypatch
):
    """``float()`` reads "nan" and "inf": a state file holding them is unreadable, and a started
    file holding no time is reported as damaged (naming the file), rather than sent on."""
    monkeypatch.setattr(files, "jobs_root", lambda: str(tmp_path))
    job_id = "ab" * 8
    directory = Path(files.job_dir(job_id))
    directory.mkdir()
    assert node_jobs.started_at(job_id) is None  # not written yet
    Path(files.started_file(str(directory))).write_text(text)
    with pytest.raises(node_jobs.DamagedState, match=f"{directory}/started holds .*, not a time"):
        node_jobs.started_at(job_id)
    Path(files.started_file(str(directory))).write_text("1700000000.125\n")
    assert node_jobs.started_at(job_id) == 1700000000.125


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_an_exit_file_holding_nan_or_inf_reads_as_unreadable(text, tmp_path, monkeypatch):
    monkeypatch.setattr(files, "jobs_root", lambda: str(tmp_path))
    job_id = "ab" * 8
    directory = Path(files.job_dir(job_id))
    directory.mkdir()
    Path(files.exit_file(str(directory))).write_text(text)  # int() of it would raise
    assert node_jobs.job_state(job_id) == (protocol.JobState.ABSENT, None)


# ---- the keeper and stop, with real processes under a private tmux server ---------------------


@pytest.fixture
def private_tmux(tmp_path, monkeypatch):
    """A tmux server and a jobs directory of the test's own: nothing left in this machine's
    /tmp/meshkit-<uid>/jobs, and no other job running here counts as a conflict."""
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))
    jobs_dir = str(tmp_path / "jobs")
    monkeypatch.setattr(files, "jobs_root", lambda: jobs_dir)
    yield
    os.system(f"TMUX_TMPDIR={shlex.quote(str(tmp_path))} tmux kill-server 2>/dev/null")


def spec(workdir: Path, cmd: str, session: str = "t") -> protocol.NodeJob:
    job = make_job(workdir=str(workdir), session=session, cmd=cmd, env={"X": "1"}, setup=())
    node_job = job.node_job()
    return protocol.NodeJob(**{**node_job.__dict__, "argv": ["bash", "-c", cmd]})


def wait_for(predicate, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout}s")


def test_kill_session_asks_tmux_only_when_its_server_is_there(private_tmux, tmp_path):
    assert not tmux.server_may_run()
    tmux.kill_session("none")  # no server, no socket: nothing to ask and no error
    subprocess.run(["tmux", "new-session", "-d", "-s", "k1", "sleep 60"], check=True, timeout=10)
    subprocess.run(["tmux", "new-session", "-d", "-s", "k10", "sleep 60"], check=True, timeout=10)
    assert tmux.server_may_run()
    tmux.kill_session("k1")  # exactly that name, not k10
    has = [
        subprocess.run(["tmux", "has-session", "-t", f"={s}"], capture_output=True, timeout=10)
        for s in ("k1", "k10")
    ]
    assert [h.returncode == 0 for h in has] == [False, True]
    subprocess.run(["tmux", "kill-server"], check=True, timeout=10)
    socket_file = tmp_path / f"tmux-{os.getuid()}" / "default"
    wait_for(lambda: not tmux.server_may_run())  # the server takes a moment to go
    assert socket_file.exists()  # tmux leaves it behind; nothing listens on it


def test_a_node_command_reports_its_status_and_stderr_and_is_bounded(tmp_path):
    from meshkit.node import command

    assert command.run(["sh", "-c", "echo out; echo err >&2; exit 3"], 10) == (3, "err\n")
    assert command.run(["sh", "-c", "read x; echo ${x:-eof} >&2"], 10) == (0, "eof\n")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        command.run(["sleep", "30"], 0.3)
    assert time.monotonic() - started < 10
    with pytest.raises(OSError):
        command.run([str(tmp_path / "no-such-command")], 10)


def test_stop_ends_what_setsid_and_env_i_detached(private_tmux, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    escaped = work / "escaped.pid"
    cmd = f"setsid env -i sh -c 'echo $$ > {escaped}; exec sleep 300' & sleep 300"
    job = spec(work, cmd)
    started = node_jobs.start(protocol.StartRequest(job))
    assert started.started, started
    assert started.state == "running", started
    pid = int(wait_for(lambda: escaped.exists() and escaped.read_text().strip()))
    assert job.job_id.encode() not in Path(f"/proc/{pid}/environ").read_bytes()  # shed the tag
    status = node_jobs.status(protocol.StatusRequest(job.job_id, str(work / "log")))
    assert status.state == "running"
    stopped = node_jobs.stop(protocol.StopRequest(job.job_id))
    assert stopped.found
    assert stopped.left == []
    assert stopped.signalled >= 3
    assert not procs.alive(pid)
    after = node_jobs.status(protocol.StatusRequest(job.job_id, str(work / "log")))
    assert after.state == "absent"


def test_stop_clears_the_flight_recorder_files_of_processes_gone():
    dead = subprocess.Popen(["true"])
    dead.wait()
    root = Path(files.state_root())
    root.mkdir(mode=0o700, exist_ok=True)
    mine = [
        root / f"fr-{os.getpid()}",
        root / "fr-",
        root / f"fr-{dead.pid}",
        root / f"fr-{dead.pid}.json",
    ]
    for path in mine:
        path.write_text("")
    node_jobs.stop(protocol.StopRequest("0" * 16))
    assert [p.exists() for p in mine] == [True, True, False, False]
    mine[0].unlink()
    mine[1].unlink()


def test_exit_code_workdir_with_format_characters_and_another_job(private_tmux, tmp_path):
    odd = tmp_path / "exp#S{r}#(touch pwned)"
    odd.mkdir()
    job = spec(odd, 'pwd > where; echo "last words"; exit 7')
    assert node_jobs.start(protocol.StartRequest(job)).started
    wait_for(lambda: (odd / "where").exists() and node_jobs.job_state(job.job_id)[0] == "exited")
    assert (odd / "where").read_text().strip() == str(odd)
    assert not (tmp_path / "pwned").exists()
    assert not Path("pwned").exists()
    assert node_jobs.job_state(job.job_id) == ("exited", 7)
    # another job (other workdir, same session name) running here blocks a start unless replace
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    first = spec(other_dir, "sleep 300")
    assert node_jobs.start(protocol.StartRequest(first)).started
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    second = spec(second_dir, "sleep 300")
    refused = node_jobs.start(protocol.StartRequest(second))
    assert not refused.started
    assert [r.job_id for r in refused.conflicts] == [first.job_id]
    assert node_jobs.job_state(first.job_id)[0] == "running"  # untouched
    taken = node_jobs.start(protocol.StartRequest(second, replace=True))
    assert taken.started
    assert [r.job_id for r in taken.replaced] == [first.job_id]
    assert node_jobs.job_state(first.job_id)[0] == "absent"
    assert node_jobs.stop(protocol.StopRequest(second.job_id)).left == []


def test_logs_tail_and_follow_offsets(tmp_path):
    log = tmp_path / "node0.log"
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    tail = node_jobs.logs(protocol.LogsRequest(str(log), 3))
    assert tail.lines == ["line 47", "line 48", "line 49"]
    with log.open("a") as out:
        out.write("new 1\npartial")
    more = node_jobs.logs(protocol.LogsRequest(str(log), 3, tail.offset))
    assert more.lines == ["new 1"]  # the partial line waits for its newline
    missing = node_jobs.logs(protocol.LogsRequest(str(tmp_path / "none"), 3))
    assert missing.missing
    assert missing.lines == []


def test_every_op_has_a_handler_and_status_imports_only_what_it_needs():
    """Handlers are imported on first use (the agent starts on every node at every command)."""
    for op in protocol.OPS:
        assert callable(agent.handler(op)), op
    code = (
        "import sys, io; from meshkit.node import agent; from meshkit import protocol;"
        "agent.serve(io.StringIO(protocol.encode_request(protocol.JobsRequest())), io.StringIO());"
        "print(sorted(m for m in sys.modules"
        " if m.startswith('meshkit') or m == 'importlib.metadata'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = out.stdout
    for heavy in (
        "meshkit.node.doctor",
        "meshkit.node.sync",
        "meshkit.node.supervise",
        "importlib.metadata",
    ):
        assert heavy not in loaded, loaded


@pytest.mark.parametrize("case", ["ok", "error"])
def test_the_agents_env_answer_is_what_meshkit_env_prints_there(tmp_path, case):
    """The preflight's discovery runs in the agent itself, in the workdir given (its meshkit.yaml
    counts): the same variables `meshkit env --json` prints there, or its error, as typed data."""
    (tmp_path / "hostfile").write_text("10.9.9.1\n10.9.9.2\n")
    (tmp_path / "meshkit.yaml").write_text("meshkit:\n  nproc_per_node: 3\n")
    hostfile = str(tmp_path / ("hostfile" if case == "ok" else "missing-hostfile"))
    argv = [sys.executable, "-m", "meshkit", "env", "--json", "--hostfile", hostfile]
    argv += ["--session", "s", "--master-port", "23456"]
    env = {**os.environ, "MESHKIT_NODE_RANK": "1"}
    fresh = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, check=False, env=env)
    os.environ["MESHKIT_NODE_RANK"] = "1"
    try:
        reply = rankenv.env(protocol.EnvRequest(str(tmp_path), hostfile, "s", 23456))
    finally:
        del os.environ["MESHKIT_NODE_RANK"]
    if case == "ok":
        data = json.loads(fresh.stdout)
        assert reply.error is None
        assert reply.source == data.pop("source") == "explicit"
        assert reply.matched == data.pop("matched")
        assert reply.interface_source == data.pop("interface_source")
        assert reply.variables == data
        assert data["NPROC_PER_NODE"] == "3"
    else:
        assert fresh.returncode != 0
        assert reply.variables == {}
        assert f"meshkit: {reply.error}" == fresh.stderr.strip()


@pytest.mark.parametrize("setup", [False, True])
def test_meshkit_run_under_the_keeper_gives_the_command_its_variables(
    private_tmux, tmp_path, setup
):
    """With or without setup lines: the node's variables, the job's tag and environment, its exit
    code, and SIGPIPE/SIGXFSZ at their defaults (`yes | head` ends quietly: Python ignores
    SIGPIPE, and an ignored signal would survive the exec)."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "hostfile").write_text("10.9.9.1\n10.9.9.2\n")
    cmd = (
        "env > env.txt; grep SigIgn /proc/self/status > sig.txt;"
        " yes | head -1 > yes.txt 2> yes.err; exit 5"
    )
    argv = [sys.executable, "-m", "meshkit", "run", "--hostfile", "hostfile", "--node-rank", "1"]
    base = spec(work, cmd)
    job = protocol.NodeJob(
        **{**base.__dict__, "argv": [*argv, "--cmd", cmd], "setup": ["true"] if setup else []}
    )
    assert node_jobs.start(protocol.StartRequest(job)).started
    wait_for(lambda: node_jobs.job_state(job.job_id)[0] == "exited")
    assert node_jobs.job_state(job.job_id) == ("exited", 5)
    env = dict(
        line.split("=", 1) for line in (work / "env.txt").read_text().splitlines() if "=" in line
    )
    assert (env["NODE_RANK"], env["NNODES"], env["MASTER_ADDR"]) == ("1", "2", "10.9.9.1")
    assert (env[procs.JOB_TAG], env["X"]) == (job.job_id, "1")
    ignored = int((work / "sig.txt").read_text().split()[1], 16)
    assert ignored & (1 << (13 - 1) | 1 << (25 - 1)) == 0  # SIGPIPE, SIGXFSZ
    assert (work / "yes.txt").read_text() == "y\n"
    assert (work / "yes.err").read_text() == ""


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\x00garbage", json.dumps({"job_id": "x", "env": {"A": 1}}).encode()],
)
def test_keeper_refuses_a_spec_it_cannot_trust(tmp_path, data):
    (tmp_path / "spec.json").write_bytes(data)
    keep = [sys.executable, "-m", "meshkit.node", "keep", str(tmp_path)]
    done = subprocess.run(keep, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert (tmp_path / "exit").read_text() == "2\n"
    assert (tmp_path / "error").read_text().startswith("unreadable job spec: ")
    assert not (tmp_path / "keeper.pid").exists()


def test_idle_counts_from_the_later_of_the_last_output_and_the_start(tmp_path: Path) -> None:
    """A relaunched job is not idle since its previous attempt's last line (it would be judged
    stalled, and restarted again, the moment it starts)."""
    log = tmp_path / "node0.log"
    log.write_text("attempt 1's last line\n")
    old = time.time() - 100
    os.utime(log, (old, old))
    assert 99 <= (node_jobs.idle(str(log), None) or 0) <= 110
    assert (node_jobs.idle(str(log), time.time() - 5) or 0) < 10
    assert node_jobs.idle(str(tmp_path / "none.log"), None) is None
    assert 4 <= (node_jobs.idle(str(tmp_path / "none.log"), time.time() - 5) or 0) < 10
