"""The console script as a user meets it: real processes, a hostfile matched by real addresses."""

import json
import subprocess
import sys

import pytest

MESHKIT = [sys.executable, "-m", "meshkit"]


def run(args, cwd, **env):
    import os

    return subprocess.run(
        [*MESHKIT, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "hostfile").write_text("10.255.255.1 slots=2\n127.0.0.1 slots=2\n")
    return tmp_path


def test_env_with_explicit_rank_prints_eval_able_exports(workdir):
    out = run(["env", "--node-rank", "1"], workdir)
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=1\n" in out.stdout
    assert "export MASTER_ADDR=10.255.255.1\n" in out.stdout


def test_env_json_keys_and_config_layers(workdir):
    (workdir / "meshkit.yaml").write_text("session: alpha\nmaster_port: 23456\n")
    data = json.loads(run(["env", "--json", "--node-rank", "0"], workdir).stdout)
    assert data["MASTER_PORT"] == "23456"
    assert data["source"] == "explicit"
    data = json.loads(
        run(["env", "--json", "--node-rank", "0"], workdir, MESHKIT_MASTER_PORT="24000").stdout
    )
    assert data["MASTER_PORT"] == "24000"
    data = json.loads(
        run(
            ["env", "--json", "--node-rank", "0", "--master-port", "25000"],
            workdir,
            MESHKIT_MASTER_PORT="24000",
        ).stdout
    )
    assert data["MASTER_PORT"] == "25000"


def test_bad_input_is_one_clear_line_no_traceback(workdir):
    (workdir / "hostfile").write_text("good\nbad:port\n")
    out = run(["env"], workdir)
    assert out.returncode != 0
    assert "hostfile:2: bad port 'port'" in out.stderr
    assert "Traceback" not in out.stderr
    out = run(["env", "--hostfile", "missing"], workdir)
    assert out.returncode != 0
    assert "missing: no such hostfile" in out.stderr
    out = run(["env", "--nproc-per-node", "zero"], workdir)
    assert out.returncode != 0
    assert "'auto'" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_execs_with_variables_and_exit_code(workdir):
    out = run(
        ["run", "--node-rank", "1", "--cmd", 'echo "$NODE_RANK/$NNODES $PET_MASTER_ADDR"; exit 3'],
        workdir,
    )
    assert out.stdout.strip() == "1/2 10.255.255.1"
    assert out.returncode == 3


def test_env_and_run_never_import_ssh_or_torch(workdir):
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "meshkit", "env", "--node-rank", "0"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = {
        line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line
    }
    assert "netifaces" in imported or "hostlist" in imported
    assert not imported & {"fabric", "paramiko", "torch"}


def test_help_lists_every_task_and_flags(workdir):
    out = run(["--list"], workdir)
    assert "env" in out.stdout
    assert "run" in out.stdout
    out = run(["env", "--help"], workdir)
    assert "--hostfile" in out.stdout
    assert "--json" in out.stdout
    assert "--node-rank" in out.stdout


def test_dash_h_is_help_everywhere_and_usage_errors_exit_2(workdir):
    for args in (["-h"], ["--help"], ["mesh", "-h"], ["status", "-h"], ["train", "--help"]):
        out = run(args, workdir)
        assert out.returncode == 0, (args, out.stderr)
        assert "Usage" in out.stdout, (args, out.stderr)
    top = run(["--help"], workdir).stdout
    for meaningless in ("--pty", "--echo", "--warn-only", "--write-pyc", "--prompt-for-sudo"):
        assert meaningless not in top
    assert "--version" in top
    assert "Exit codes" in top
    for args in (
        ["status", "--bogus"],
        ["nosuchtask"],
        ["train", "--session", "my.job", "--cmd", "x"],
    ):
        out = run(args, workdir)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
        assert out.stderr.startswith("meshkit: ")


def test_sandbox_up_help_names_the_sandbox_user():
    """The task list does not load the sandbox package, so its help spells the user's name: the
    same one the sandbox creates."""
    from meshkit.cli.tasks import sandbox as tasks
    from meshkit.sandbox.user import NAME

    assert NAME in tasks.up.help["user"]
