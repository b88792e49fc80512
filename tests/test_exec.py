"""``meshkit exec`` and ``Cluster.exec``: one command on every node, its output grouped as
``clush -b`` groups it, each node's exit code, bounded in time and memory, and ended everywhere by
one Ctrl-C. The node side and the pure parts here; then on a sandbox of real sshd nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from meshkit import Cluster, sandbox
from meshkit.errors import UsageError
from meshkit.node import execute as node_exec
from meshkit.node import procs
from meshkit.ops.execute import NodeResult, fold, gather, parse_ranks
from meshkit.protocol import EXEC_KEEP, MAX_LINE, ExecReply, ExecRequest, encode_reply
from tests.conftest import MESHKIT, meshkit, ssh
from tests.helpers.sandbox_jobs import wait_for

SANDBOX_NODES = 4
GIB = 1 << 30


def request(cmd: str, timeout: float = 30.0, rank: int = 1) -> ExecRequest:
    return ExecRequest(cmd, rank, 3, "127.0.0.1", 25000, "s", timeout)


# ---- pure: ranks, groups, names ------------------------------------------------------------------


def test_node_ranks_are_numbers_and_ranges_inside_the_hostfile():
    assert parse_ranks(None, 4) == [0, 1, 2, 3]
    assert parse_ranks("2", 4) == [2]
    assert parse_ranks("3,0-1", 6) == [0, 1, 3]
    for bad in ("4", "x", "1-", "2-1", "-1", "1,,2"):
        with pytest.raises(UsageError, match="--node"):
            parse_ranks(bad, 4)


def result(rank: int, stdout: str, code: int | None = 0, error: str | None = None) -> NodeResult:
    return NodeResult(f"node{rank}", rank, code, stdout, "", error)


def test_identical_outputs_are_one_group_named_as_clush_names_nodes():
    results = [result(0, "a\n"), result(1, "a\n"), result(2, "b\n"), result(3, "a\n")]
    results += [result(5, "a\n"), result(4, "", None, "unreachable: refused")]
    groups = gather(results)
    assert [(group.nodes, group.stdout) for group in groups] == [
        ("node[0-1,3,5]", "a\n"),
        ("node2", "b\n"),
    ]
    assert fold(["10.0.0.2", "10.0.0.3", "10.0.0.5"]) == "10.0.0.[2-3,5]"
    assert not results[-1].ok
    assert results[-1].why == "unreachable: refused"
    assert result(6, "", 3).why == "exit code 3"


# ---- the node side, with real processes on this machine ------------------------------------------


def test_the_node_exports_its_rank_and_keeps_each_exit_code():
    reply = node_exec.run(request("echo $NODE_RANK $NNODES $MASTER_ADDR; echo e >&2; exit 3"), None)
    assert reply == ExecReply(3, "1 3 127.0.0.1\n", "e\n")
    killed = node_exec.run(request("kill -9 $$"), None)
    assert killed.exit_code == 137  # as a shell says it


def test_output_is_cut_to_its_head_and_tail_on_the_node_and_fits_a_reply_line():
    reply = node_exec.run(request("head -c 20M /dev/zero; echo; echo end"), None)
    assert reply.stdout_cut == 20 * 1024 * 1024 + 5 - 2 * EXEC_KEEP
    assert f"[meshkit exec: {reply.stdout_cut} bytes cut]\n" in reply.stdout
    assert reply.stdout.endswith("\nend\n")
    kept = node_exec.Kept(3)
    kept.add("abé".encode())  # the head ends inside "é", the tail starts there
    kept.add(b"cd")
    assert (kept.text(), kept.cut) == ("abécd", 0)
    kept.add(b"efgh")
    assert (kept.text(), kept.cut) == ("ab\ufffd\n[meshkit exec: 4 bytes cut]\nfgh", 4)
    # NUL bytes are JSON's longest escape (6 bytes each); both streams cut still fit one line
    both = node_exec.run(request("head -c 1M /dev/zero; head -c 1M /dev/zero >&2"), None)
    assert len(encode_reply(both)) < MAX_LINE


def test_a_timeout_or_the_controller_leaving_ends_the_whole_process_group():
    started = time.monotonic()
    reply = node_exec.run(request("sleep 300 & sleep 301", timeout=0.5), None)
    assert reply.exit_code is None
    assert reply.error == "timed out after 0.5s (its process group was killed)"
    assert time.monotonic() - started < 3
    # the agent's stdin closing (the controller gone) is seen while the command runs
    read_end, write_end = os.pipe()
    marker = f"/tmp/meshkit-test-exec-{os.getpid()}"
    cmd = f"echo $$ > {marker}; sleep 300 & sleep 301"
    try:
        closer = subprocess.Popen(
            ["bash", "-c", f"sleep 1; exec {write_end}>&-"], pass_fds=[write_end]
        )
        os.close(write_end)
        reply = node_exec.run(request(cmd), read_end)
        closer.wait()
        assert reply.error == "the controller left (its process group was killed)"
        with open(marker) as handle:
            group = int(handle.read())
        assert procs.in_group(group) == []
    finally:
        os.close(read_end)
        if os.path.exists(marker):
            os.unlink(marker)


# ---- on the sandbox ----------------------------------------------------------------------------


def run_exec(cluster: sandbox.Layout, *args: str) -> subprocess.CompletedProcess[str]:
    return meshkit("exec", "--hostfile", str(cluster.hostfile), *args, timeout=120)


def test_identical_and_differing_outputs_are_grouped_and_a_failing_node_is_named(cluster):
    cmd = 'uname -s; if [ "$NODE_RANK" = 2 ]; then echo odd; exit 4; fi'
    out = run_exec(cluster, "--cmd", cmd)
    nodes = cluster.nodes
    same = fold([nodes[0].address, nodes[1].address, nodes[3].address])
    header = f"{same} (3)"
    odd = f"{nodes[2].address} (1)"
    expected = [
        "-" * len(header),
        header,
        "-" * len(header),
        "Linux",
        "-" * len(odd),
        odd,
        "-" * len(odd),
        "Linux",
        "odd",
    ]
    assert out.stdout.splitlines() == expected
    assert out.returncode == 1
    assert f"meshkit exec: {nodes[2].address} (rank 2): exit code 4" in out.stderr
    assert "1 of 4 nodes failed" in out.stderr

    # --exclude leaves node 0 out: the others are ranks 0..2 (as `meshkit env --exclude` says),
    # and --node picks among those
    cmd = "echo a $NODE_RANK $NNODES; echo b >&2"
    selected = ["--exclude", nodes[0].address, "--node", "0-1"]
    lines = run_exec(cluster, "--lines", *selected, "--cmd", cmd)
    assert lines.returncode == 0
    expected = [f"{nodes[1].address}: a 0 3", f"{nodes[2].address}: a 1 3"]
    assert lines.stdout.splitlines() == expected
    assert f"{nodes[2].address}: b" in lines.stderr.splitlines()


def test_each_node_has_its_own_rank_and_json_has_its_fixed_keys(cluster):
    out = run_exec(cluster, "--json", "--cmd", 'echo $NODE_RANK; echo "$NNODES" >&2')
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    keys = {"node", "rank", "exit_code", "stdout", "stderr", "error"}
    keys |= {"stdout_cut_bytes", "stderr_cut_bytes"}  # issue 43: how many bytes each cut
    assert [set(row) for row in rows] == [keys] * SANDBOX_NODES
    assert [(row["node"], row["rank"], row["exit_code"]) for row in rows] == [
        (node.address, node.index, 0) for node in cluster.nodes
    ]
    assert [row["stdout"] for row in rows] == [f"{node.index}\n" for node in cluster.nodes]
    assert {row["stderr"] for row in rows} == {f"{SANDBOX_NODES}\n"}


def test_the_bashrc_runs_once_per_node_and_cannot_override_the_variables(cluster):
    """~/.bashrc runs in the login shell that starts each node's agent, and what it exports
    reaches the command; not again in the command's own shell, where it would override
    meshkit's variables and cost every node a second shell start."""
    node = cluster.nodes[1]
    bashrc = cluster.node_dir(node) / "bashrc"
    runs = cluster.node_dir(node) / "tmp" / "bashrc-runs"
    before = bashrc.read_text()
    exports = "export NODE_RANK=from-bashrc FROM_BASHRC=yes\necho run >> /tmp/bashrc-runs\n"
    bashrc.write_text(before + exports)
    try:
        cmd = 'echo "$NODE_RANK $FROM_BASHRC"'
        out = run_exec(cluster, "--lines", "--node", "1", "--cmd", cmd)
    finally:
        bashrc.write_text(before)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{node.address}: 1 yes"]
    assert runs.read_text().splitlines() == ["run"]


def test_the_python_api_returns_a_typed_result_per_node(cluster, capsys):
    results = Cluster(str(cluster.hostfile)).exec("echo $NODE_RANK; exit $NODE_RANK", nodes="0,2")
    assert results == [
        NodeResult(cluster.nodes[0].address, 0, 0, "0\n", ""),
        NodeResult(cluster.nodes[2].address, 2, 2, "2\n", ""),
    ]
    assert capsys.readouterr().out == ""


def test_a_node_printing_a_gibibyte_is_cut_there_and_the_controller_stays_small(cluster, tmp_path):
    argv = [*MESHKIT, "exec", "--hostfile", str(cluster.hostfile), "--node", "1", "--json"]
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        process = subprocess.Popen(
            [*argv, "--cmd", "head -c 1G /dev/zero; echo; echo last"], stdout=out, stderr=err
        )
        # the controller's own peak resident memory (os.wait4: this child alone), in KiB
        _, wait_status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(wait_status)
    assert process.returncode == 0, (tmp_path / "err").read_text()
    (row,) = json.loads((tmp_path / "out").read_text())
    cut = GIB + 6 - 2 * EXEC_KEEP
    assert f"[meshkit exec: {cut} bytes cut]\n" in row["stdout"]
    assert row["stdout"].endswith("\nlast\n")
    assert usage.ru_maxrss < 150 * 1024, usage.ru_maxrss  # about 50 MiB; a GiB held would show


def sleepers() -> list[int]:
    """This machine's ``sleep 9173``/``sleep 9174`` processes: the nodes' too (each node's pid
    namespace is inside this one), looked at in milliseconds."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and procs.cmdline(int(name))[:2] in (
            ["sleep", "9173"],
            ["sleep", "9174"],
        ):
            found.append(int(name))
    return found


def test_one_ctrl_c_ends_the_command_on_every_node(cluster):
    marks = cluster.shared / "exec-groups"
    marks.mkdir()
    cmd = f"sleep 9173 & echo $$ > {marks}/$NODE_RANK; sleep 9174; echo never"
    controller = subprocess.Popen(
        [*MESHKIT, "exec", "--hostfile", str(cluster.hostfile), "--cmd", cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: len(sleepers()) == 2 * SANDBOX_NODES, timeout=60, interval=0.1)
    wait_for(lambda: len(list(marks.iterdir())) == SANDBOX_NODES, timeout=10, interval=0.1)
    controller.send_signal(signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = controller.communicate(timeout=10)
    assert controller.returncode == 130, stderr
    assert time.monotonic() - sent < 2.5
    assert "never" not in stdout
    # within a second or two of the Ctrl-C, nothing of the command is left on any node ...
    wait_for(lambda: not sleepers(), timeout=2, interval=0.05)
    # ... as each node sees it: its process group is empty
    for node in cluster.nodes:
        group = (marks / str(node.index)).read_text().strip()
        looked = ssh(cluster, node.name, f"ps -o pid=,args= -g {group}; pgrep -a -x sleep")
        assert "917" not in looked.stdout, (node.name, looked.stdout)


def test_an_unreachable_node_is_named_with_why_and_the_others_still_answer(cluster):
    down = cluster.nodes[3]
    sandbox.kill_node(down.netns)
    try:
        out = run_exec(cluster, "--cmd", "echo up")
        assert out.returncode == 1
        expected = fold([node.address for node in cluster.nodes[:3]])
        assert f"{expected} (3)" in out.stdout
        failures = [line for line in out.stderr.splitlines() if down.address in line]
        assert len(failures) == 1, out.stderr
        assert failures[0].startswith(f"meshkit exec: {down.address} (rank 3): unreachable: ")
        assert "Traceback" not in out.stderr
    finally:
        sandbox.reboot(cluster, down.index)


def test_bad_flags_are_usage_errors_before_any_node(cluster):
    out = run_exec(cluster, "--cmd", "true", "--timeout", "0")
    assert out.returncode == 2
    assert "--timeout '0'" in out.stderr
    out = run_exec(cluster, "--cmd", "true", "--node", "7")
    assert out.returncode == 2
    assert "the hostfile has ranks 0..3" in out.stderr
    out = meshkit("exec", "--hostfile", str(cluster.hostfile))
    assert out.returncode == 2
