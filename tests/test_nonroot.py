"""The whole flow as an ordinary user, as most people on shared GPU nodes are: the sandbox's
user (``meshkit-user``, see meshkit.sandbox.user), with a home of its own on every node and its
own key, known_hosts and hostfile on the controller. As that user: ``mesh`` from the controller
(this machine), ``train`` from one node, ``status``, ``logs`` and ``diagnose`` from another node
and another directory (its health: the kernel log unread, said so), ``stop``, and a supervised
job relaunched after a node reboots. The user
runs a Python environment of its own (helpers.other_user): this checkout may be one it cannot
enter."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import fresh_sandbox, named, need_root, sandbox_name
from helpers.other_user import as_user, login_env, readable_python
from helpers.sandbox_jobs import RESULT, check_results, wait_for

from meshkit import sandbox
from meshkit.errors import SandboxError

SANDBOX_NODES = 2
NPROC = 1  # one rank a node: several local ranks are test_train's part (sandbox_jobs.NPROC)
USER = sandbox.USER
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "meshkit" / "templates" / "example_train.py"


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    with fresh_sandbox(sandbox_name(__name__), SANDBOX_NODES, user=True) as created:
        yield created


@pytest.fixture(scope="module")
def python(lay) -> Iterator[Path]:
    """The user's interpreter, at one path on the controller and every node (/var/tmp)."""
    with readable_python(USER, ["torch"]) as interpreter:
        yield interpreter


def on_controller(lay, python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``meshkit ARGS`` run by the user on the controller, from its own files' directory."""
    return subprocess.run(
        [*as_user(USER), str(python), "-m", "meshkit", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=lay.user_dir,
        env=login_env(USER, python),
        check=False,
    )


def login(lay, python: Path, index: int, line: str) -> subprocess.CompletedProcess[str]:
    """``line`` in the user's shell on node ``index``, logged in by its key through sshd."""
    node = lay.nodes[index].name
    ssh = ["ssh", "-F", str(lay.user_ssh_config), "-o", "BatchMode=yes", node, line]
    return subprocess.run(
        [*as_user(USER), *ssh],
        capture_output=True,
        text=True,
        timeout=180,
        env=login_env(USER, python),
        check=False,
    )


def inside(lay, python: Path, index: int, cwd: str, *args: str):
    """``meshkit ARGS`` run by the user on node ``index``, from directory ``cwd``."""
    command = shlex.join([str(python), "-m", "meshkit", *args])
    return login(lay, python, index, f"cd {cwd} && {command}")


def project(lay, name: str) -> Path:
    """A workdir of the user's on the shared storage (an admin made it and gave it away), with
    a hostfile of the nodes and the example job."""
    user = sandbox.user.account()
    assert user is not None
    work = lay.shared / name
    work.mkdir()
    shutil.copy(lay.user_hostfile, work / "hostfile")
    shutil.copy(EXAMPLE, work / "example_train.py")
    for path in (work, work / "hostfile", work / "example_train.py"):
        os.chown(path, user.uid, user.gid)
    return work


@pytest.fixture(scope="module")
def meshed(lay, python) -> subprocess.CompletedProcess[str]:
    out = on_controller(lay, python, "mesh", "--hostfile", str(lay.user_hostfile))
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_a_place_the_user_could_not_reach_is_refused_before_anything_is_made(tmp_path):
    need_root()
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    name = named("nclosed")
    where = closed / "sandbox"
    with pytest.raises(SandboxError, match=f"{closed} is closed to other users"):
        sandbox.up(where, sandbox.default_subnet("", name), 1, name, user=True)
    assert not where.exists()


def test_the_user_logs_in_by_key_to_a_home_of_its_own_on_every_node(lay, python):
    user = sandbox.user.account()
    assert user is not None
    for index in range(len(lay.nodes)):
        out = login(lay, python, index, 'id -un; echo "$HOME"; hostname > ~/where')
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [USER, str(user.home)]
    for node in lay.nodes:
        where = lay.user_home(node) / "where"
        assert where.read_text() == f"{node.name}\n"  # each node's own, not shared
        assert where.stat().st_uid == user.uid
    assert not (user.home / "where").exists()  # nor the controller's


def test_mesh_from_the_controller_with_the_users_own_key_and_known_hosts(lay, python, meshed):
    user = sandbox.user.account()
    assert user is not None
    homes = [lay.user_home(node) / ".ssh" for node in lay.nodes]
    own_keys = [(home / "id_ed25519.pub").read_text().split()[1] for home in homes]
    assert len(set(own_keys)) == len(lay.nodes)  # a key per node: homes are not shared
    bootstrap = lay.key.with_suffix(".pub").read_text()
    for node, home in zip(lay.nodes, homes):
        assert (home / "id_ed25519").stat().st_uid == user.uid
        authorized = (home / "authorized_keys").read_text()
        assert all(key in authorized for key in own_keys), authorized
        known = (home / "known_hosts").read_text()
        assert all(other.address in known for other in lay.nodes), known
        # root's own ~/.ssh on the node is untouched: the sandbox's bootstrap key alone
        assert (lay.node_dir(node) / "ssh" / "authorized_keys").read_text() == bootstrap
    # node0 reaches node1 by the mesh alone (nodes never see the controller's key)
    reached = login(lay, python, 0, f"ssh -o BatchMode=yes {lay.nodes[1].address} hostname")
    assert reached.returncode == 0, reached.stderr
    assert reached.stdout.strip() == lay.nodes[1].name


def status(lay, python: Path, index: int, cwd: str, *where: str) -> list[dict[str, object]]:
    out = inside(lay, python, index, cwd, "status", "--json", *where)
    assert out.returncode in (0, 1), out.stdout + out.stderr
    return json.loads(out.stdout)


def owners(lay, pattern: str) -> list[set[str]]:
    """Per node: the users running a process whose command line holds ``pattern``."""
    found = []
    for node in lay.nodes:
        listed = sandbox.node_exec(node, ["ps", "-eo", "user:32=,args="]).stdout.splitlines()
        found.append({line.split()[0] for line in listed if pattern in line})
    return found


def test_train_status_logs_diagnose_and_stop_as_the_user(lay, python, meshed):
    """The one torch run: gloo between the user's ranks on both nodes."""
    work = project(lay, "project")
    where = ("--hostfile", str(work / "hostfile"), "--session", "first")
    command = "python example_train.py --sleep 300"
    train = ["train", *where, "--spawn", "--nproc-per-node", str(NPROC), "--cmd", command]
    out = inside(lay, python, 0, str(work), *train)
    assert out.returncode == 0, out.stdout + out.stderr
    world = len(lay.nodes) * NPROC

    logs = [work / ".meshkit" / "first" / f"node{rank}.log" for rank in range(len(lay.nodes))]

    def printed() -> bool:
        texts = [log.read_text() for log in logs if log.exists()]
        return sum(len(RESULT.findall(text)) for text in texts) == world

    wait_for(printed, timeout=240, interval=1)
    shown = inside(lay, python, 1, "~", "logs", *where, "--lines", "20")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    found = []
    for line in shown.stdout.splitlines():
        match = RESULT.search(line)
        if match:
            found.append((int(line[1 : line.index("]")]), match))
    check_results(found, len(lay.nodes), NPROC)
    rows = status(lay, python, 1, "~", *where)
    assert [row["state"] for row in rows] == ["running"] * len(lay.nodes), rows
    # the kernel log is root's here (kernel.dmesg_restrict): health says it was not read, so
    # the node is "unknown", never "ok", and the job runs
    for row in rows:
        assert row["health"]["state"] == "unknown", row
        assert any("kernel: not read" in why for why in row["health"]["reasons"]), row
    # the ranks are the user's, and so is each node's state directory
    assert owners(lay, "example_train") == [{USER}] * len(lay.nodes)
    user = sandbox.user.account()
    assert user is not None
    for node in lay.nodes:
        state_dir = f"/tmp/meshkit-{user.uid}"
        shown = sandbox.node_exec(node, ["stat", "-c", "%U %a", state_dir]).stdout.split()
        assert shown == [USER, "700"], shown
    found = inside(lay, python, 1, "~", "diagnose", *where, "--json")
    assert found.returncode == 0, found.stdout + found.stderr
    ranks = json.loads(found.stdout)["ranks"]
    assert sorted(rank["rank"] for rank in ranks) == list(range(world))
    for rank in ranks:
        assert rank["error"] is None, rank
        assert "example_train.py:" in rank["frames"][-1], rank  # its stack, read by py-spy
    stop = inside(lay, python, 1, "~", "stop", *where)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert stop.stdout.count("nothing left") == len(lay.nodes), stop.stdout
    assert [row["state"] for row in status(lay, python, 0, "/tmp", *where)] == ["absent"] * 2
    assert owners(lay, "example_train") == [set()] * len(lay.nodes)


def test_a_supervised_job_is_relaunched_after_a_reboot(lay, python, meshed):
    work = project(lay, "supervised")
    where = ("--hostfile", str(work / "hostfile"), "--session", "sup")
    command = 'echo "attempt on $NODE_RANK"; sleep 300'
    train = ["train", *where, "--restarts", "1", "--cmd", command]
    out = inside(lay, python, 0, str(work), *train)
    assert out.returncode == 0, out.stdout + out.stderr

    def supervised_and_running(attempt: int):
        def ready() -> list[dict[str, object]] | None:
            rows = status(lay, python, 0, "~", *where)
            if [row["state"] for row in rows] != ["running"] * len(lay.nodes):
                return None
            if rows[0]["supervisor"] != "running" or rows[0]["attempt"] != attempt:
                return None
            return rows

        return ready

    wait_for(supervised_and_running(1), timeout=120, interval=1)
    sandbox.reboot(lay, 1)
    rows = wait_for(supervised_and_running(2), timeout=240, interval=1)
    assert "node 1 " in str(rows[0]["last_restart_reason"]), rows
    # running is the keeper's state; its `meshkit run` starts the command once it discovered
    # the node's rank, a second or so later under load: wait for the user's own processes, and
    # for the relaunch's first line in the log (CI once read it before it was written)
    expected = [{USER}] * len(lay.nodes)
    wait_for(lambda: owners(lay, "sleep 300") == expected, timeout=30, interval=1)
    log = work / ".meshkit" / "sup" / "node1.log"

    def relaunched() -> bool:
        return log.read_text().count("attempt on 1") == 2  # before the reboot, and relaunched

    wait_for(relaunched, timeout=30, interval=1)
    stop = inside(lay, python, 1, "~", "stop", *where)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert stop.stdout.count("nothing left") == len(lay.nodes), stop.stdout
    assert owners(lay, "meshkit supervise") == [set()] * len(lay.nodes)
