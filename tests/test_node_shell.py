"""When the node shell stops answering, the error says what was seen (the connection closed, or
the shell exited with its status and last words) and the likely causes, a reboot first; missing
tools only when what was seen points at them. The pure choice of message, then on a sandbox: a
node rebooted, and a node shell killed, mid-request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import fresh_sandbox, named

from meshkit import sandbox
from meshkit.discovery import read_hosts
from meshkit.errors import MeshkitError
from meshkit.remote import Settings, SshGroup
from meshkit.remote.node_shell import NodeShell, shell_ended

TOOLS = "sh, head, base64, stat and flock are needed"


def test_a_closed_connection_says_so_and_a_reboot_first():
    said = shell_ended(False, None, "")
    assert said.startswith("the connection to the node closed while its shell was answering: ")
    assert "likely the node rebooting" in said
    assert TOOLS not in said
    # its ~/.bashrc's complaint is no reason to blame the tools for a dropped connection
    assert TOOLS not in shell_ended(False, None, "bash: conda: command not found\n")


def test_an_exit_says_its_status_and_last_words():
    said = shell_ended(True, 1, "first\nsh: 3: oops\n\n")
    assert said.startswith("the node's shell exited with status 1, saying 'sh: 3: oops': ")
    assert "likely the node rebooting" in said
    assert TOOLS not in said
    killed = shell_ended(True, None, "")
    assert killed.startswith("the node's shell ended without an exit status (killed by a signal)")
    assert TOOLS not in killed


def test_tools_are_named_only_when_what_was_seen_points_at_them():
    assert TOOLS in shell_ended(True, 127, "")
    assert TOOLS in shell_ended(True, 1, "sh: 1: flock: not found\n")
    assert TOOLS not in shell_ended(True, 1, "bash: conda: command not found\nsh: 1: oops\n")


# ---- on a sandbox ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    with fresh_sandbox(named("nshell"), 2) as layout:
        yield layout


def busy_shell(lay: sandbox.Layout, index: int) -> tuple[NodeShell, SshGroup]:
    """A node shell on node ``index`` that answered once and is now running a 30 s request."""
    hosts = read_hosts(lay.hostfile)
    settings = Settings(connect_timeout=5.0, ssh_configs=(str(lay.ssh_config),))
    group = SshGroup([hosts[index]], settings)
    assert not group.failures, group.failures
    shell = NodeShell(group.remotes[hosts[index]])
    assert shell.ask("home")[0].status == "ok"
    shell.send(("sh 8", b"sleep 30"))
    return shell, group


def test_a_reboot_mid_request_is_reported_as_the_connection_closing(lay):
    shell, group = busy_shell(lay, 0)
    try:
        sandbox.reboot(lay, 0)
        started = time.monotonic()
        with pytest.raises(MeshkitError) as error:
            shell.receive(1)
        assert time.monotonic() - started < 10
    finally:
        group.close()
    said = str(error.value)
    assert said.startswith("the connection to the node closed while its shell was answering")
    assert "likely the node rebooting" in said
    assert TOOLS not in said


def ancestors(pid: int, parents: dict[int, int]) -> list[int]:
    """``pid`` and its parents, up to the node's first process."""
    chain = [pid]
    while chain[-1] in parents and parents[chain[-1]] not in chain and len(chain) < 64:
        chain.append(parents[chain[-1]])
    return chain


def test_a_killed_node_shell_is_reported_as_such(lay):
    shell, group = busy_shell(lay, 1)
    try:
        node = lay.nodes[1]
        listing = sandbox.node_exec(node, ["ps", "-ww", "-eo", "pid=,ppid=,args="]).stdout
        parents = {}
        shells = []
        for line in listing.splitlines():
            pid, ppid, args = line.split(None, 2)
            parents[int(pid)] = int(ppid)
            if args.endswith(f"meshkit {shell.token}"):  # the node shell, not what it runs
                shells.append(int(pid))
        # a pipeline's side forks a copy of the shell with its arguments: not another shell
        shells = [pid for pid in shells if parents[pid] not in shells]
        assert len(shells) == 1, listing
        # the shell this test started and what it runs (which holds its output open), by pid
        doomed = [pid for pid in parents if shells[0] in ancestors(pid, parents)]
        killed = sandbox.node_exec(node, ["kill", "-KILL", *map(str, doomed)])
        # a pipeline's short-lived side may have ended since the listing: only the shell's own
        # kill must land
        gone = [line for line in killed.stderr.splitlines() if "No such process" in line]
        assert killed.returncode == 0 or len(gone) == len(killed.stderr.splitlines()), killed
        assert not any(f"({shells[0]})" in line for line in gone), killed.stderr
        started = time.monotonic()
        with pytest.raises(MeshkitError) as error:
            shell.receive(1)
    finally:
        group.close()
    said = str(error.value)
    assert time.monotonic() - started < 10
    assert said.startswith("the node's shell "), said
    assert "likely the node rebooting" in said
    assert TOOLS not in said
