"""Spare nodes without a cluster: a job's membership and how it changes (pure), what every rank
is told of its attempt, the flags that bound a replacement, and `meshkit env` on a spare (this
machine's own addresses in a hostfile on disk)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.saved_jobs import saved_job

from meshkit import localnet
from meshkit.discovery import discover, read_hosts
from meshkit.distenv import NodeEnv
from meshkit.errors import HostfileError, JobError, TopologyError, UsageError
from meshkit.hostfile import Host, parse
from meshkit.job import REPLACE_AFTER, Job, from_json, parse_duration, restart_env
from meshkit.jobindex import index_file
from meshkit.ops import train
from meshkit.ops.lookup import Options, check_options, job_hosts, min_nodes_flag
from meshkit.ops.membership import members_of, plan, reason_of_change, spares_of
from meshkit.ops.supervision_policy import Heard, NodeView, restart_reason, waited_only
from meshkit.protocol import JobState, RestartReason, Supervision, SupervisorState
from meshkit.record import replace
from meshkit.settings import Config

CLUSTER = parse(
    "n1 slots=2\nn2 slots=2\nn3 slots=2\nn4 slots=2\ns1 slots=2 spare\ns2 slots=2 spare\n"
)
N1, N2, N3, N4, S1, S2 = CLUSTER
MEMBERS = [N1, N2, N3, N4]


def labels(hosts: list[Host]) -> list[str]:
    return [host.label for host in hosts]


# ---- which node holds each rank ---------------------------------------------------------------


def test_the_members_are_the_launched_nodes_until_a_record_names_them():
    assert members_of(None, MEMBERS, CLUSTER) == MEMBERS
    first = Supervision(SupervisorState.RUNNING, 1, 2)
    assert members_of(first, MEMBERS, CLUSTER) == MEMBERS
    moved = replace(first, generation=2, members=["n1", "s1", "n3", "n4"])
    assert members_of(moved, MEMBERS, CLUSTER) == [N1, S1, N3, N4]


def test_a_member_the_hostfile_no_longer_lists_is_a_job_error_naming_it():
    moved = Supervision(SupervisorState.RUNNING, 2, 2, generation=2, members=["n1", "gone", "n3"])
    with pytest.raises(JobError, match="the job's nodes gone are not in the hostfile any more"):
        members_of(moved, MEMBERS, CLUSTER)


def test_the_spares_are_the_hostfiles_other_nodes_in_hostfile_order():
    assert spares_of(CLUSTER, MEMBERS) == [S1, S2]
    # n2 was lost and s1 took its rank: n2 (back again) is a spare now, before s2
    assert spares_of(CLUSTER, [N1, S1, N3, N4]) == [N2, S2]


def test_the_job_hosts_follow_the_saved_membership():
    job = Job("x", "/w", "s", "/h", "/p", 1, restarts=2)
    assert job_hosts(job, CLUSTER) == MEMBERS  # no membership yet: the lines that are not spares
    moved = replace(job, generation=2, members=("s1", "n2", "n3", "n4"))
    assert job_hosts(moved, CLUSTER) == [S1, N2, N3, N4]
    with pytest.raises(JobError, match="/h: the job's nodes x9 are not in the hostfile"):
        job_hosts(replace(moved, members=("x9", "n2")), CLUSTER)


# ---- how the membership changes ---------------------------------------------------------------


def test_a_lost_node_is_replaced_by_the_first_spare_and_every_other_rank_stays():
    change = plan(MEMBERS, [N3], [S1, S2], CLUSTER, None)
    assert change is not None
    assert change.reason == RestartReason.REPLACED
    assert change.members == [N1, N2, S1, N4]
    assert (change.lost, change.added, change.replaced) == ([N3], [S1], ["n3 -> s1"])
    assert reason_of_change(change) == "replaced: n3 -> s1 (n3 lost)"


def test_the_masters_loss_makes_its_spare_rank_0():
    change = plan(MEMBERS, [N1], [S2], CLUSTER, None)
    assert change is not None
    assert change.members == [S2, N2, N3, N4]


def test_several_lost_nodes_take_the_spares_in_order_by_rank():
    change = plan(MEMBERS, [N4, N2], [S1, S2], CLUSTER, None)
    assert change is not None
    assert change.members == [N1, S1, N3, S2]
    assert change.replaced == ["n2 -> s1", "n4 -> s2"]
    assert reason_of_change(change) == "replaced: n2 -> s1; n4 -> s2 (n4, n2 lost)"


def test_nothing_lost_no_change():
    assert plan(MEMBERS, [], [S1], CLUSTER, 1) is None


def test_no_spare_and_no_min_nodes_is_no_change_and_so_is_too_few_spares():
    assert plan(MEMBERS, [N2], [], CLUSTER, None) is None
    assert plan(MEMBERS, [N2, N3], [S1], CLUSTER, None) is None  # a part of the ranks is no job


def test_a_shrink_renumbers_the_nodes_left_in_hostfile_order():
    change = plan(MEMBERS, [N2], [], CLUSTER, 3)
    assert change is not None
    assert change.reason == RestartReason.SHRUNK
    assert (change.members, change.lost, change.added, change.replaced) == (
        [N1, N3, N4],
        [N2],
        [],
        [],
    )
    assert reason_of_change(change) == (
        "shrunk: n2 lost and no healthy spare; running on the 3 nodes left"
    )
    # s1 took n2's rank once (generation 2); n4 is lost now: s1 moves after n3, as the file has it
    change = plan([N1, S1, N3, N4], [N4], [], CLUSTER, 3)
    assert change is not None
    assert change.members == [N1, N3, S1]


def test_min_nodes_bounds_a_shrink_and_only_a_majority_may_shrink():
    five = [N1, N2, N3, N4, S1]
    shrunk = plan(five, [N2, N4], [], CLUSTER, 3)
    assert shrunk is not None
    assert shrunk.members == [N1, N3, S1]
    assert plan(five, [N2, N4], [], CLUSTER, 4) is None  # fewer than --min-nodes left
    assert plan(five, [N2, N3, N4], [], CLUSTER, 1) is None  # 2 of 5: a minority
    assert plan(MEMBERS, [N3, N4], [], CLUSTER, 2) is None  # half is no majority either
    assert plan([N1, N2], [N2], [], CLUSTER, 1) is None


def test_too_few_spares_take_what_ranks_they_can_and_the_job_shrinks_by_the_rest():
    five = [N1, N2, N3, N4, S1]
    partial = plan(five, [N4, N2], [S2], CLUSTER, 3)
    assert partial is not None
    assert partial.reason == RestartReason.SHRUNK
    # n2 (the lower rank) gets the spare; n4 none: a shrink, renumbered in hostfile order
    assert partial.members == [N1, N3, S1, S2]
    assert (partial.added, partial.replaced, partial.dropped) == ([S2], ["n2 -> s2"], [N4])
    assert partial.lost == [N4, N2]
    assert reason_of_change(partial) == (
        "shrunk: n2 -> s2; no healthy spare for n4 (n4, n2 lost); running on 4 nodes"
    )
    # the spare is what keeps --min-nodes 4: without it, too few are left
    assert plan(five, [N2, N4], [], CLUSTER, 4) is None
    with_spare = plan(five, [N2, N4], [S2], CLUSTER, 4)
    assert with_spare is not None
    assert with_spare.members == [N1, N3, S1, S2]
    # no --min-nodes, or fewer left than it: no shrink, spares or not (wait, then give up)
    assert plan(five, [N2, N4], [S2], CLUSTER, None) is None
    assert plan(five, [N2, N4], [S2], CLUSTER, 5) is None
    # only the nodes that survived count toward the majority, not the spares joining them: a
    # partition's minority with a spare on its side must not go on beside the rest
    assert plan(MEMBERS, [N3, N4], [S1], CLUSTER, 1) is None
    assert plan(five, [N2, N3, N4], [S2], CLUSTER, 1) is None


# ---- what a supervisor writes and follows -----------------------------------------------------


def views(*states: JobState | Heard) -> list[NodeView]:
    return [NodeView(rank, f"10.0.0.{rank + 1}", state) for rank, state in enumerate(states)]


def test_every_rank_is_told_why_its_attempt_was_launched():
    running = JobState.RUNNING
    assert restart_reason(views(running, JobState.EXITED), None) == RestartReason.FAILURE
    assert restart_reason(views(running, Heard.UNREACHABLE), None) == RestartReason.FAILURE
    assert restart_reason(views(running, running), "no output for 30m") == RestartReason.STALL
    failed_while_stalled = views(running, JobState.EXITED)
    assert restart_reason(failed_while_stalled, "no output") == RestartReason.FAILURE
    rebooted = views(JobState.EXITED, JobState.ABSENT, running)
    assert restart_reason(rebooted, "no output") == RestartReason.REBOOT


def test_only_a_note_of_what_a_relaunch_waits_for_lets_it_go_on():
    seen = Supervision(SupervisorState.RUNNING, 2, 1, "node 1 exited", version=5, by=0)
    assert waited_only(seen, seen)
    noted = replace(seen, version=6, by=1, waiting="node 2 (n3) until 21:00:00 UTC")
    assert waited_only(seen, noted)
    assert not waited_only(seen, replace(seen, version=6))  # written with no note: moved on
    claimed = replace(noted, supervisor=SupervisorState.RELAUNCHING)
    assert not waited_only(seen, claimed)
    assert not waited_only(seen, replace(noted, generation=2, members=["n1", "s1"]))
    assert not waited_only(seen, replace(noted, held="n2: workdir: read-only"))


# ---- the job: its membership's hostfile, and what every rank is told -------------------------


def test_a_changed_membership_has_its_own_hostfile_and_no_include_or_exclude():
    job = Job(
        "x", "/w", "s", "/h", "/p", 29500, 2, include="n1,n2,n3,n4,s1", exclude="n3", restarts=2
    )
    argv = job.meshkit_argv("run")
    assert argv[argv.index("--hostfile") + 1] == "/h"
    assert argv[argv.index("--include") + 1] == "n1,n2,n3,n4,s1"
    assert argv[argv.index("--exclude") + 1] == "n3"
    moved = replace(job, generation=3, members=("n1", "n2", "s1", "n4"))
    assert moved.node_hostfile == "/w/.meshkit/s/members-3"
    assert replace(moved, sync=True).node_hostfile == "/w/.meshkit/s/members-3"
    assert moved.env_request().hostfile == "/w/.meshkit/s/members-3"
    argv = moved.node_job(2).argv
    assert argv[argv.index("--hostfile") + 1] == "/w/.meshkit/s/members-3"
    assert "--include" not in argv
    assert "--exclude" not in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    again = from_json(moved.to_json(), "job.json")
    assert again == moved
    assert again.members == ("n1", "n2", "s1", "n4")


def test_every_rank_learns_its_restart_count_reason_and_generation():
    job = Job(
        "x", "/w", "s", "/h", "/p", 1, restarts=2, env={"MESHKIT_GENERATION": "mine", "K": "v"}
    )
    first = job.node_job().env
    assert first == {
        "K": "v",
        "MESHKIT_RESTART_COUNT": "0",
        "MESHKIT_RESTART_REASON": "start",
        "MESHKIT_GENERATION": "1",  # the supervisor's, over a same-named variable of the job
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    moved = replace(job, generation=2, members=("n1", "s1"))
    env = moved.node_job(3, RestartReason.REPLACED, "n2 -> s1").env
    assert env["MESHKIT_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert (env["MESHKIT_RESTART_REASON"], env["MESHKIT_GENERATION"]) == ("replaced", "2")
    assert env["MESHKIT_REPLACED"] == "n2 -> s1"
    assert "MESHKIT_REPLACED" not in restart_env(2, "failure", 1, "")


# ---- the flags: --replace-after and --min-nodes ----------------------------------------------


def test_replace_after_is_a_duration_or_off():
    assert Job("x", "/w", "s", "/h", "/p", 1).replace_after == REPLACE_AFTER == 300.0
    assert parse_duration("90s", "--replace-after") == 90.0
    assert parse_duration("5m", "--replace-after") == 300.0
    assert parse_duration("off", "--replace-after") is None
    assert parse_duration(" OFF ", "--replace-after") is None
    for bad in ("0", "soon", "-5m", "31d"):
        with pytest.raises(UsageError, match="--replace-after"):
            check_options(Options(replace_after=bad))


def test_min_nodes_is_a_whole_number_of_nodes():
    assert min_nodes_flag(None) is None
    assert min_nodes_flag(" 3 ") == 3
    assert min_nodes_flag(4096) == 4096
    for bad in ("0", "x", "2.5", "-1", "4097"):
        with pytest.raises(UsageError, match="--min-nodes"):
            check_options(Options(min_nodes=bad))


@pytest.fixture
def spare_hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("10.255.0.1\n10.255.0.2\n10.255.0.3\n10.255.0.9 spare\n")
    return path


def train_options(hostfile: Path, **flags: object) -> Options:
    workdir = str(hostfile.parent)
    return Options(cmd="python t.py", workdir=workdir, hostfile=str(hostfile), **flags)


def test_train_takes_replace_after_and_min_nodes_up_to_the_jobs_node_count(spare_hostfile):
    job, hosts = train.plan(Config(), train_options(spare_hostfile, restarts=2))
    assert len(hosts) == 3  # the spare takes no rank
    assert (job.replace_after, job.min_nodes, job.generation) == (REPLACE_AFTER, None, 1)
    given = train_options(spare_hostfile, restarts=2, replace_after="off", min_nodes="3")
    job, hosts = train.plan(Config(), given)
    assert (job.replace_after, job.min_nodes) == (None, 3)
    job, _ = train.plan(Config(), train_options(spare_hostfile, replace_after="90s"))
    assert job.replace_after == 90.0
    with pytest.raises(UsageError, match="--min-nodes 4: the job has 3 nodes; give at most that"):
        train.plan(Config(), train_options(spare_hostfile, restarts=2, min_nodes=4))


def test_replace_after_given_supervises_a_job_with_no_restarts(spare_hostfile):
    """`--restarts 0 --replace-after D`: a supervisor runs for lost nodes alone; `--restarts 0`
    alone, or with `--replace-after off`, runs none; `--restarts N` always does."""
    job, _ = train.plan(Config(), train_options(spare_hostfile, restarts=0, replace_after="30s"))
    assert (job.restarts, job.replace_after, job.supervised) == (0, 30.0, True)
    job, _ = train.plan(Config(), train_options(spare_hostfile, restarts=0))
    assert not job.supervised
    off = train_options(spare_hostfile, restarts=0, replace_after="off")
    assert not train.plan(Config(), off)[0].supervised
    assert train.plan(Config(), train_options(spare_hostfile, restarts=2))[0].supervised


def test_filters_that_keep_only_spares_leave_no_job_to_start(spare_hostfile):
    """`train --include SPARE` would start a job of no node; `mesh --include SPARE` meshes it."""
    with pytest.raises(HostfileError, match="leave only spare lines, which take no rank"):
        train.plan(Config(), train_options(spare_hostfile, include="10.255.0.9"))
    with pytest.raises(HostfileError, match="leave only spare lines"):
        read_hosts(spare_hostfile, exclude="10.255.0.[1-3]")
    assert labels(read_hosts(spare_hostfile, "10.255.0.9", spares=True)) == ["10.255.0.9"]


def test_a_new_job_is_one_generation_past_the_saved_one_of_its_workdir_and_session(
    spare_hostfile,
):
    job, _ = train.plan(Config(), train_options(spare_hostfile, restarts=2))
    old = replace(job, generation=3, members=("10.255.0.1", "10.255.0.9", "10.255.0.3"))
    Path(old.file).parent.mkdir(parents=True)
    Path(old.file).write_text(old.to_json())
    again, hosts = train.plan(Config(), train_options(spare_hostfile, restarts=2))
    assert again.generation == 4
    assert again.members == ()  # a new job runs on the hostfile's nodes again
    assert len(hosts) == 3


# ---- `meshkit env` on a spare ------------------------------------------------------------------


def this_machines_address() -> str:
    """An IPv4 address of this machine that tells it apart (as a hostfile line would give it)."""
    for entry in localnet.local_addresses():
        address = entry.address
        if "." in address and not address.startswith(("127.", "169.254.")):
            return address
    pytest.skip("this machine has no IPv4 address but loopback")


@pytest.fixture
def on_a_spare(tmp_path: Path) -> tuple[Path, str]:
    """A hostfile whose third line, a spare, is this machine."""
    mine = this_machines_address()
    path = tmp_path / "hostfile"
    path.write_text(f"10.255.0.1 slots=2\n10.255.0.2 slots=2\n{mine} slots=2 spare\n")
    return path, mine


def env_on(hostfile: Path, session: str = "s") -> NodeEnv:
    return discover(hostfile, session=session, environ={"MESHKIT_HOSTNAME": "not-a-line"})


def test_env_on_a_spare_says_it_is_a_spare_of_the_hostfile(on_a_spare):
    hostfile, _ = on_a_spare
    with pytest.raises(TopologyError) as err:
        env_on(hostfile)
    text = str(err.value)
    assert text.startswith(f"{hostfile}:3: this machine (not-a-line) is a spare of this hostfile")
    assert "`meshkit status` shows the membership" in text


def test_env_on_a_spare_whose_job_gave_it_no_rank_still_says_it_is_a_spare(on_a_spare):
    hostfile, mine = on_a_spare
    saved_job(hostfile, (), generation=1)  # the job as launched: the spare takes no rank
    with pytest.raises(TopologyError, match="is a spare of this hostfile"):
        env_on(hostfile)
    # another session's membership gives it a rank: not this session's job
    saved_job(hostfile, ("10.255.0.1", mine), generation=2)
    with pytest.raises(TopologyError, match="is a spare of this hostfile"):
        env_on(hostfile, session="other")


def test_env_on_a_spare_that_took_a_lost_nodes_rank_prints_that_rank(on_a_spare):
    hostfile, mine = on_a_spare
    job = saved_job(hostfile, ("10.255.0.1", mine), generation=2)  # 10.255.0.2 was lost
    node = env_on(hostfile)
    assert node.node_rank == 1
    assert node.nnodes == 2
    assert node.master_addr == "10.255.0.1"
    assert node.master_port == job.master_port
    assert node.nproc_per_node == 2
    # the master was lost: the spare is rank 0 and the master
    saved_job(hostfile, (mine, "10.255.0.2"), generation=3)
    node = env_on(hostfile)
    assert (node.node_rank, node.master_addr) == (0, mine)


def test_a_job_file_that_does_not_read_leaves_the_spare_a_spare(on_a_spare):
    hostfile, mine = on_a_spare
    job = saved_job(hostfile, ("10.255.0.1", mine))
    Path(job.file).write_text("{not json")
    with pytest.raises(TopologyError, match="is a spare of this hostfile"):
        env_on(hostfile)
    Path(job.index).write_text('{"workdir": "relative/path"}')
    with pytest.raises(TopologyError, match="is a spare of this hostfile"):
        env_on(hostfile)


@pytest.fixture
def on_a_member(tmp_path: Path) -> tuple[Path, str]:
    """A hostfile whose third line, not a spare, is this machine."""
    mine = this_machines_address()
    path = tmp_path / "hostfile"
    path.write_text(
        f"10.255.0.1 slots=2\n10.255.0.2 slots=2\n{mine} slots=2\n10.255.0.9 slots=2 spare\n"
    )
    return path, mine


def test_env_on_a_member_prints_its_rank_in_the_jobs_changed_membership(on_a_member):
    hostfile, mine = on_a_member
    assert env_on(hostfile).node_rank == 2  # no saved job: its line's rank
    saved_job(hostfile, (), generation=1)  # the job as launched: the hostfile's ranks
    assert env_on(hostfile).node_rank == 2
    # 10.255.0.2 lost, no spare healthy, --min-nodes: the job shrank, this node is rank 1 now
    job = saved_job(hostfile, ("10.255.0.1", mine), generation=2)
    node = env_on(hostfile)
    assert (node.node_rank, node.nnodes, node.master_addr) == (1, 2, "10.255.0.1")
    assert (node.master_port, node.nproc_per_node) == (job.master_port, 2)
    assert env_on(hostfile, session="other").node_rank == 2  # another session's job: not this
    # the master lost: this node is rank 0 and the master
    saved_job(hostfile, (mine, "10.255.0.9", "10.255.0.2"), generation=3)
    node = env_on(hostfile)
    assert (node.node_rank, node.master_addr) == (0, mine)
    # this node lost and replaced (it came back): no rank in the job, and it says why
    saved_job(hostfile, ("10.255.0.1", "10.255.0.2", "10.255.0.9"), generation=4)
    with pytest.raises(TopologyError) as err:
        env_on(hostfile)
    text = str(err.value)
    assert text.startswith(f"{hostfile}:3: this machine (not-a-line) is not in the membership")
    assert "session s's job (generation 4)" in text


def test_the_index_env_reads_is_the_one_the_job_writes():
    job = Job("x", "/w", "s-1", "/cluster/hosts", "/p", 1)
    assert index_file("/cluster/hosts", "s-1") == job.index


def meshkit_env(cwd: Path) -> subprocess.CompletedProcess[str]:
    environ = {name: value for name, value in os.environ.items() if not name.startswith("MESHKIT")}
    return subprocess.run(
        [sys.executable, "-m", "meshkit", "env", "--session", "s"],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_meshkit_env_on_a_spare_exits_non_zero_with_the_reason_unless_it_took_a_rank(on_a_spare):
    hostfile, mine = on_a_spare
    out = meshkit_env(hostfile.parent)
    assert out.returncode != 0
    assert "is a spare of this hostfile" in out.stderr
    assert "Traceback" not in out.stderr
    saved_job(hostfile, (mine, "10.255.0.2"))
    out = meshkit_env(hostfile.parent)
    assert out.returncode == 0, out.stderr
    assert "export NODE_RANK=0\n" in out.stdout
    assert f"export MASTER_ADDR={mine}\n" in out.stdout
    assert "export MASTER_PORT=25123\n" in out.stdout
