"""The fast path for env/run must be indistinguishable from the invoke tasks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from meshkit import envrun as fastcli
from meshkit import settings
from meshkit.cli.execute import declared
from meshkit.cli.tasks import ns
from meshkit.errors import ConfigError


def fast_flags(task: str) -> set[tuple[str, bool]]:
    """The flags the plain parser takes for ``task``, each with whether it is a boolean: env's and
    run's from envrun, exec's from its one declaration (``cli/execute.py``)."""
    if task == "exec":
        names, booleans = declared()
        return {(name, name in booleans) for name in names}
    return {(name, name in fastcli.BOOLEAN) for name in fastcli.FLAGS[task]}


@pytest.mark.parametrize("task", sorted([*fastcli.FLAGS, "exec"]))
def test_same_flags_as_the_invoke_task_and_no_short_flags(task):
    invoke_args = {(argument.name, argument.kind is bool) for argument in ns[task].get_arguments()}
    fast_args = fast_flags(task)
    assert fast_args == invoke_args
    assert all(
        not argument.nicknames for argument in ns[task].get_arguments()
    )  # -h is help, nothing else


def both_paths(args, cwd, env):
    fast = subprocess.run(
        [sys.executable, "-m", "meshkit", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    slow = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from meshkit.cli.main import program; program().run()",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    return fast, slow


@pytest.mark.parametrize("config", ["meshkit.yaml", "meshkit.json"])
def test_same_output_with_config_files_and_env(tmp_path, config):
    (tmp_path / "hostfile").write_text("10.255.255.1 slots=2\n10.255.255.2 slots=2\n")
    body = (
        "session: alpha\nnproc_per_node: 3\n"
        if config.endswith("yaml")
        else '{"meshkit": {"session": "alpha"}}'
    )
    (tmp_path / config).write_text(body)
    for args in (
        ["env", "--node-rank", "1"],
        ["env", "--json", "--node-rank=0", "--master-port", "24000"],
        ["run", "--node-rank", "1", "--cmd", "echo $NODE_RANK $MASTER_PORT $NPROC_PER_NODE"],
    ):
        fast, slow = both_paths(args, tmp_path, {"MESHKIT_EXCLUDE": "nothing-matches"})
        assert (fast.returncode, fast.stdout, fast.stderr) == (
            slow.returncode,
            slow.stdout,
            slow.stderr,
        ), args
    fast, slow = both_paths(["env", "--node-rank", "0"], tmp_path, {"MESHKIT_MASTER_PORT": "21000"})
    assert "export MASTER_PORT=21000" in fast.stdout
    assert fast.stdout == slow.stdout


def test_errors_match_and_unknown_flags_fall_back(tmp_path):
    (tmp_path / "hostfile").write_text("a\nb:0\n")
    fast, slow = both_paths(["env"], tmp_path, {})
    assert fast.returncode == slow.returncode == 2  # a bad hostfile is bad input
    assert fast.stderr == slow.stderr
    fast, slow = both_paths(["env", "--bogus"], tmp_path, {})
    assert fast.returncode != 0
    assert "--bogus" in fast.stdout + fast.stderr


@pytest.mark.parametrize(
    ("hostfile", "flags", "message"),
    [
        ("a\nb:0\n", [], "hostfile:2: bad port '0'"),
        (None, ["--hostfile", "missing"], "missing: no such hostfile"),
        ("10.255.255.1\n10.255.255.2\n", [], "matches no line"),  # not this machine
    ],
)
def test_bad_hostfiles_and_a_machine_not_in_it_exit_2_on_both_paths(
    tmp_path, hostfile, flags, message
):
    """Bad input exits 2 everywhere (README's exit codes), the hostfile included; a hostfile that
    does not list this machine is bad input too: nothing failed on a node, the fix is the
    hostfile or --node-rank."""
    if hostfile is not None:
        (tmp_path / "hostfile").write_text(hostfile)
    for task in (["env"], ["run", "--cmd", "true"]):
        fast, slow = both_paths([*task, *flags], tmp_path, {})
        assert fast.returncode == slow.returncode == 2, (task, fast.stderr, slow.stderr)
        assert message in fast.stderr, fast.stderr
        # the first line: the local addresses listed after it come and go with other sandboxes
        assert fast.stderr.splitlines()[0] == slow.stderr.splitlines()[0]
        assert "Traceback" not in fast.stderr + slow.stderr


def test_settings_layering_without_invoke(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meshkit.yaml").write_text("meshkit:\n  session: beta\n  sandbox:\n    nodes: 5\n")
    conf = settings.load({"MESHKIT_CONNECT_TIMEOUT": "4", "MESHKIT_SESSION": "gamma"})
    assert conf.session == "gamma"
    assert conf.connect_timeout == 4.0
    assert conf.sandbox.nodes == 5
    assert conf.sandbox.subnet == "10.77.0.0/24"


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("connect_timeout: soon\n", {}, "connect_timeout = 'soon': expected a number of seconds"),
        ("parallel: 0\n", {}, "parallel = '0': expected a whole number 1..1024"),
        ("sessoin: x\n", {}, "unknown key 'sessoin'"),
        ("env:\n  'A;rm -rf /': x\n", {}, "is not a variable name"),
        ("- a\n- b\n", {}, "expected a mapping of meshkit keys"),
        ("hostfile: [\n", {}, "not valid YAML"),
        ("", {"MESHKIT_MASTER_PORT": "70000"}, "MESHKIT_MASTER_PORT: master_port = '70000'"),
        ("", {"MESHKIT_ENV": "A=1"}, "MESHKIT_ENV='A=1': expected JSON"),
    ],
)
def test_bad_configuration_is_a_clear_usage_error(tmp_path, monkeypatch, text, env, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meshkit.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings.load(env)
    (tmp_path / "hostfile").write_text("10.255.255.1\n")
    fast, slow = both_paths(["env", "--node-rank", "0"], tmp_path, env)
    assert fast.returncode == slow.returncode == 2, (fast.stderr, slow.stderr)
    assert message in fast.stderr
    assert "Traceback" not in fast.stderr + slow.stderr


def test_the_fast_parser_takes_only_what_it_is_sure_of():
    flags = fastcli.parse("env", ["--json", "--hostfile=h f", "--node-rank", "2"])
    assert flags.given == {"json"}
    assert flags.values["hostfile"] == "h f"
    assert flags.values["node_rank"] == "2"
    assert flags.values["session"] is None
    for args in (
        ["--host", "h"],  # abbreviated: argparse (allow_abbrev=False) and invoke refuse it
        ["--node_rank", "1"],  # not the flag's spelling
        ["--hostfile"],  # no value
        ["--hostfile", "--json"],  # a flag where the value should be
        ["--json=yes"],
        ["hostfile"],  # a positional
        ["--cmd", "x"],  # not an env flag
    ):
        with pytest.raises(fastcli.Fallback):
            fastcli.parse("env", args)


def test_env_imports_no_typing_argparse_or_ssh(tmp_path):
    (tmp_path / "hostfile").write_text("10.9.9.1\n10.9.9.2\n")
    code = (
        "import sys, io, contextlib\n"
        "sys.argv = ['meshkit', 'env', '--node-rank', '1']\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    from meshkit.cli.main import main\n"
        "    main()\n"
        "heavy = ('typing', 'argparse', 'invoke', 'fabric', 'paramiko', 'torch', 'meshkit.job')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_exec_runs_without_invoke_and_fails_as_its_task_does(tmp_path):
    """``meshkit exec`` with ordinary flags skips the invoke Program (its start is a good part of
    a round of seconds); what it prints and its exit code are the task's. These fail before any
    node is contacted, so no nodes are needed."""
    (tmp_path / "hostfile").write_text("10.255.255.1\n10.255.255.2\n")
    for args in (
        ["exec", "--cmd", "true", "--hostfile", "absent"],
        ["exec", "--cmd", "true", "--node", "0-5"],
        ["exec", "--cmd", "true", "--timeout=0", "--json"],
        ["exec", "--cmd", "true", "--lines", "--include", "nothing*"],
        ["exec", "--node", "1"],  # no --cmd: the task's usage error
        ["exec", "--cmd", "true", "--nodes", "1"],  # not a flag of exec
    ):
        fast, slow = both_paths(args, tmp_path, {})
        assert fast.returncode == slow.returncode == 2, (args, fast.stderr, slow.stderr)
        assert (fast.stdout, fast.stderr) == (slow.stdout, slow.stderr), args
    code = (
        "import sys\n"
        "sys.argv = ['meshkit', 'exec', '--cmd', 'true', '--node', '7']\n"
        "from meshkit.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    print(exc.code)\n"
        "print([m for m in ('invoke', 'meshkit.cli.tasks') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[:2] == ["2", "[]"], out.stdout + out.stderr
