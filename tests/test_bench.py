"""The benchmark's pure parts: medians, ratios, the README table, and the parsers that decide
whether a tool reached its end state. Runs no benchmark and builds no cluster."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's benchmarks/ package

from benchmarks import campaign, goodput, peers, recovery, render, stats


def line(rank: int, world: int, host: str, total: int | None = None) -> str:
    want = world * (world + 1) // 2
    got = want if total is None else total
    return (
        f"meshkit-example rank={rank} world_size={world} node_rank=0 meshkit_node_rank=None "
        f"local_rank={rank % 2} host={host} sum={got} expected={want} ok={got == want}"
    )


def test_median_ignores_failed_samples_and_ratio_needs_both():
    assert stats.median([3.0, None, 1.0, 2.0]) == 2.0
    assert stats.median([None, None]) is None
    assert stats.ratio(2.5, 1.25) == 2.0
    assert stats.ratio(None, 1.0) is None
    assert stats.ratio(1.0, None) is None
    assert stats.ratio(1.0, 0.0) is None


def test_summarize_gives_medians_and_ratios_to_the_floor_of_the_same_n():
    medians, ratios = stats.summarize(
        {"round/floor": [1.0, 1.2, 0.8], "mesh/ansible": [7.0, 8.0, 6.0], "mesh/seed": [None]}
    )
    assert medians == {"round/floor": 1.0, "mesh/ansible": 7.0, "mesh/seed": None}
    assert ratios == {"round/floor": 1.0, "mesh/ansible": 7.0, "mesh/seed": None}


def doc() -> dict[str, object]:
    rows = []
    for nodes, floor in ((2, 0.5), (4, 0.8)):
        medians, ratios = stats.summarize(
            {
                "round/floor": [floor],
                "mesh/meshkit_no_verify": [floor * 1.5],
                "mesh/ansible": [None],
            }
        )
        rows.append(
            {
                "nodes": nodes,
                "median_s": medians,
                "ratio_to_floor": ratios,
                "skipped": {"mesh/seed": "peers only up to --peers-max 2"} if nodes == 4 else {},
                "failures": {"mesh/ansible": ["exit 2: unreachable"]},
            }
        )
        if nodes == 2:
            rows[-1]["median_s"]["mesh/seed"] = 3.0  # type: ignore[index]
            rows[-1]["ratio_to_floor"]["mesh/seed"] = 6.0  # type: ignore[index]
    return {
        "sizes": rows,
        "machine": {"cpus": 2},
        "env": {"meshkit_env_s": 0.07, "bare_import_netifaces_s": 0.03, "env/bare": 2.33},
    }


def test_table_has_one_row_per_n_and_only_measured_columns():
    text = stats.table(doc())
    lines = text.splitlines()
    header = "| N | floor (ssh true ×N) | mesh --no-verify | Ansible mesh | seed script |"
    assert lines[0] == header
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2] == "| 2 | 0.50 | 0.75 (1.50×) | failed | 3.00 (6.00×) |"
    assert lines[3] == "| 4 | 0.80 | 1.20 (1.50×) | failed | – |"


def test_render_only_draws_both_plots_from_a_document(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(doc()))
    text = render.render(json.loads((tmp_path / "results.json").read_text()), tmp_path)
    assert (tmp_path / "time_vs_n.png").stat().st_size > 0
    assert (tmp_path / "ratio_to_floor.png").stat().st_size > 0
    assert "N=2 mesh/ansible FAILED: exit 2: unreachable" in text
    assert "2.33×" in text


def test_each_ratio_uses_the_floor_of_its_own_cluster_not_a_pooled_one():
    """A fresh cluster's floor and a meshed one's differ: pooled, the median floor of the round
    would pair a mesh with another cluster's floor."""
    raw = {
        "round/floor": [1.0, 2.0, 2.0],
        "mesh/meshkit_no_verify": [1.2],
        "round/meshkit_status": [1.0, None],
    }
    cluster = {
        "round/floor": ["r1/mesh/meshkit_no_verify", "r1/ops", "r2/ops"],
        "mesh/meshkit_no_verify": ["r1/mesh/meshkit_no_verify"],
        "round/meshkit_status": ["r1/ops", "r2/ops"],
    }
    floors = {"r1/mesh/meshkit_no_verify": 1.0, "r1/ops": 2.0, "r2/ops": 2.0}
    medians, ratios = stats.summarize(raw, cluster, floors)
    assert medians["round/floor"] == 2.0
    assert ratios == {
        "round/floor": 1.0,
        "mesh/meshkit_no_verify": 1.2,  # pooled: 0.6
        "round/meshkit_status": 0.5,
    }
    # a sample whose cluster's floor failed has no ratio
    _, ratios = stats.summarize(raw, cluster, {**floors, "r1/mesh/meshkit_no_verify": None})
    assert ratios["mesh/meshkit_no_verify"] is None


def test_shells_per_node_are_the_median_of_means_and_the_most_on_any_node():
    got = stats.shells_summary({"mesh/meshkit_no_verify": [[3, 3, 5], [3, 3, 3], [4, 4, 4]]})
    assert got == {"mesh/meshkit_no_verify": {"mean": 3.67, "max": 5}}
    assert stats.shells_summary({"x": [[]]}) == {}


def test_a_figure_checked_on_a_sample_of_the_pairs_says_so():
    document = doc()
    rows = document["sizes"]
    assert isinstance(rows, list)
    rows[1]["pairs_checked"] = {"mesh/meshkit_no_verify": [[16, 16 * 16]]}
    rows[0]["pairs_checked"] = {"mesh/meshkit_no_verify": [[4, 4]]}
    lines = stats.table(document).splitlines()
    assert lines[2].split(" | ")[2] == "0.75 (1.50×)"
    assert lines[3].split(" | ")[2] == "1.20 (1.50×)ˢ"
    assert lines[-1] == (
        "ˢ end state checked on a sample of the pairs (above --n2-max): N=4: 16 of 256 pairs."
    )
    assert (
        render.sampled_note(document)
        == "open marks: end state checked on a sample of pairs (N=4: 16 of 256)"
    )
    head = stats.headline(document).splitlines()[0]
    assert head == "| N | floor (ssh true ×N), s | mesh --no-verify |"


def test_sizes_take_repeats_per_n():
    from benchmarks.run import sizes_arg

    assert sizes_arg("2,4,64x2,244x1", 3) == [(2, 3), (4, 3), (64, 2), (244, 1)]
    for bad in ("245", "0", "8x0", "²", "8x", "x2"):
        with pytest.raises(SystemExit):
            sizes_arg(bad, 3)


def test_series_skips_missing_values():
    assert render.series(doc(), "median_s")["mesh/seed"] == [(2, 3.0)]


def test_launch_reached_when_every_rank_printed_the_right_sum_two_per_host():
    world = 4
    text = "\n".join(
        f"node{rank // 2}: " + line(rank, world, f"node{rank // 2}") for rank in range(world)
    )
    found = stats.rank_lines(text)
    assert [launch.rank for launch in found] == [0, 1, 2, 3]
    assert stats.launch_problems(found, nodes=2, per_node=2) == []


def test_launch_problems_name_missing_ranks_wrong_sums_and_crowded_hosts():
    found = stats.rank_lines(
        "\n".join([line(0, 4, "node0"), line(1, 4, "node0", total=3), line(2, 4, "node0")])
    )
    problems = stats.launch_problems(found, nodes=2, per_node=2)
    assert problems[0] == "ranks seen [0, 1, 2], want 0..3"
    assert "rank 1: world_size=4 sum=3, want 4 and 10" in problems
    assert problems[-1] == "ranks per host {'node0': 3}, want 2 on each of 2"


def test_answered_reads_pdsh_and_gathered_clush_output():
    names = ["node0", "node1", "node2"]
    assert stats.answered("node1: node1\nnode0: node0\n", names) == ["node0", "node1"]
    rule = "---------------"
    clush = f"{rule}\nnode0\n{rule}\nnode0\n{rule}\nnode2\n{rule}\nnode2\n"
    assert stats.answered(clush, names) == ["node0", "node2"]
    assert stats.answered("node1: ssh: connect to host node1: Connection refused", names) == []


def test_pair_failures_from_check_json():
    ok = {"nodes": ["a", "b"], "ok": True, "failures": []}
    assert stats.pair_failures(ok) == []
    bad = {
        "ok": False,
        "failures": [{"from": "a", "to": "b", "error": "Host key verification failed."}],
    }
    assert stats.pair_failures(bad) == ["a -> b: Host key verification failed."]
    assert stats.pair_failures({"ok": True}) == ["no failures list in check's JSON"]


def test_log_ranks_from_meshkit_logs_prefixes():
    assert stats.log_ranks("[0] a\n[1] b\n[0] c\nno prefix [5] here\n") == [0, 1]


def test_pdsh_launch_takes_its_rank_from_pdsh():
    command = peers.pdsh_torchrun_command(Path("/w d"), Path("/v/torchrun"), 4, 2, "node0", 29500)
    assert command == (
        "cd '/w d' && /v/torchrun --nnodes=4 --node-rank=%n --nproc-per-node=2 "
        "--master-addr=node0 --master-port=29500 example_train.py"
    )
    assert peers.pdsh_argv(["node0", "node1"], "true") == [
        "pdsh",
        "-R",
        "ssh",
        "-S",
        "-f",
        "2",
        "-w",
        "node0,node1",
        "true",
    ]


def test_wait_exits_reads_each_nodes_new_job_only_and_names_who_is_missing(tmp_path):
    import ipaddress

    import pytest

    from benchmarks import harness, launches
    from meshkit.sandbox.layout import Layout

    lay = Layout(tmp_path, ipaddress.IPv4Network("10.9.0.0/24"), 2)
    jobs = [lay.node_dir(node) / "tmp" / f"meshkit-{os.getuid()}" / "jobs" for node in lay.nodes]
    for directory in jobs:
        (directory / "old").mkdir(parents=True)
        (directory / "old" / "exit").write_text("9\n")  # an earlier job's: never read
    before = launches.job_dirs(lay)
    for directory in jobs:
        (directory / "new").mkdir()
    (jobs[0] / "new" / "exit").write_text("0\n")
    with pytest.raises(harness.StepFailed, match=r"ranks done on \['node0'\] only"):
        launches.wait_exits(lay, before, timeout=0.1)
    (jobs[1] / "new" / "exit").write_text("1\n")
    assert launches.wait_exits(lay, before, timeout=0.1) == {"node0": "0", "node1": "1"}


def test_launch_orders_balance_position_and_predecessor_over_six_repeats():
    from collections import Counter

    from benchmarks.launches import launch_order

    orders = [launch_order(repeat) for repeat in range(6)]
    assert len(set(orders)) == 6
    assert launch_order(6) == orders[0]
    for position in range(3):
        assert Counter(order[position] for order in orders) == {0: 2, 1: 2, 2: 2}
    after = Counter((order[i], order[i + 1]) for order in orders for i in range(2))
    assert set(after.values()) == {2}
    assert len(after) == 6


def test_settle_returns_once_the_machine_is_idle_and_never_waits_past_its_limit():
    from benchmarks.harness import machine_busy, settle

    assert machine_busy() > 0
    assert settle(limit=0.3, window=0.1, idle=2.5) < 0.3  # 2.5 cores' worth of "idle": at once
    assert settle(limit=0.3, window=0.1, idle=-1.0) < 0.6  # never idle enough: the limit


def test_four_launch_orders_are_a_williams_square():
    """With --spawn: each launch in each place once, and right after each other launch once,
    in every four repeats."""
    from benchmarks.launches import launch_order

    orders = [launch_order(repeat, 4) for repeat in range(4)]
    assert launch_order(4, 4) == orders[0]
    for place in range(4):
        assert sorted(order[place] for order in orders) == [0, 1, 2, 3]
    pairs = [(order[i], order[i + 1]) for order in orders for i in range(3)]
    assert sorted(pairs) == sorted(
        (first, then) for first in range(4) for then in range(4) if first != then
    )


def test_a_row_pairs_each_sample_with_its_clusters_floor_and_counts_its_shells(
    tmp_path, monkeypatch
):
    """Row.sample on a conda-bashrc layout (files only, no nodes): the shells each step started
    on each node (what the nodes' bashrc appends to their /tmp/.meshkit-shells), each sample's
    cluster, and the ratio to that cluster's own floor."""
    from benchmarks.harness import StepFailed
    from benchmarks.measurement import Row, count_floor_shells
    from meshkit import sandbox

    clock = [0.0]  # each step takes exactly the seconds it is given
    monkeypatch.setattr("benchmarks.measurement.time.perf_counter", lambda: clock[0])

    def cluster(name: str) -> sandbox.Layout:
        lay = sandbox.layout(tmp_path / name, "10.77.3.0/24", 2, "b", bashrc="conda")
        for node in lay.nodes:
            (lay.node_dir(node) / "tmp").mkdir(parents=True)
        return lay

    def shells(lay: sandbox.Layout, per_node: list[int], seconds: float) -> Callable[[], None]:
        def step() -> None:
            for node, count in zip(lay.nodes, per_node):
                with open(lay.node_dir(node) / "tmp" / ".meshkit-shells", "a") as handle:
                    handle.write("".join(f"cmd {i}\n" for i in range(count)))
            clock[0] += seconds

        return step

    row = Row(2)
    fresh = cluster("fresh")
    meshed = cluster("meshed")
    row.on(fresh, "r1/mesh/meshkit_no_verify")
    row.sample("round", "floor", shells(fresh, [1, 1], 0.1))
    count_floor_shells(row, fresh)
    row.sample("mesh", "meshkit_no_verify", shells(fresh, [3, 4], 0.12))
    row.on(meshed, "r1/ops")
    row.sample("round", "floor", shells(meshed, [1, 2], 0.3))
    with pytest.raises(StepFailed, match=r"\[1, 2\], want 1 on each node"):
        count_floor_shells(row, meshed)
    doc = row.as_json()
    assert doc["cluster"] == {
        "round/floor": ["r1/mesh/meshkit_no_verify", "r1/ops"],
        "mesh/meshkit_no_verify": ["r1/mesh/meshkit_no_verify"],
    }
    assert doc["shells_raw"]["mesh/meshkit_no_verify"] == [[3, 4]]
    assert doc["shells_per_node"]["mesh/meshkit_no_verify"] == {"mean": 3.5, "max": 4}
    assert doc["shell_commands_node0"]["mesh/meshkit_no_verify"] == ["cmd 0", "cmd 1", "cmd 2"]
    # 0.12 s over its own cluster's 0.1 s floor, not over the pooled median of 0.1 and 0.3
    assert doc["ratio_to_floor"]["mesh/meshkit_no_verify"] == 1.2


def test_recovery_table_has_a_line_per_repeat_and_path_then_each_paths_medians():
    xid = [
        {"detected": 2.0, "evicted": 2.1, "claimed": 5.0, "running": 6.0},
        {"detected": 4.0, "evicted": 4.1, "claimed": 7.0, "running": 9.0},
        {"detected": 3.0, "evicted": 3.1, "claimed": 6.0, "running": 7.5},
    ]
    lost = [{"noticed": 16.0, "lost": 26.0, "claimed": 27.0, "running": 30.0, "over_bound": 20.0}]
    samples = {"xid": xid, "lost": lost}
    medians = recovery.medians(samples)
    assert medians["xid"] == {"detected": 3.0, "evicted": 3.1, "claimed": 6.0, "running": 7.5}
    assert medians["lost"]["running"] == 30.0
    lines = recovery.table(samples).splitlines()
    assert len(lines) == 3 + 1 + 2
    assert lines[0].startswith("xid   #1") and "running   6.00" in lines[0]
    assert lines[3].startswith("lost  #1") and "over_bound  20.00" in lines[3]
    assert lines[4].startswith("xid   median") and "detected   3.00" in lines[4]
    assert recovery.medians({"xid": [], "lost": lost}).keys() == {"lost"}


def test_recovery_alternates_the_paths_and_takes_replacements_flags():
    assert recovery.order(0) == ["xid", "lost"] and recovery.order(1) == ["lost", "xid"]
    args = recovery.parse([])
    assert (args.nodes, args.repeats, args.bound) == (8, 3, 10.0)
    assert args.out.name == "recovery.json"
    args = recovery.parse(["2", "--repeats", "1", "--replace-after", "5", "--out", "x.json"])
    assert (args.nodes, args.repeats, args.bound, str(args.out)) == (2, 1, 5.0, "x.json")
    with pytest.raises(SystemExit):
        recovery.parse(["1"])


def test_goodput_campaign_is_fixed_by_its_seed_and_spares_node_0():
    first = campaign.campaign(45, campaign.KINDS, 8)
    assert first == campaign.campaign(45, campaign.KINDS, 8)
    assert sorted(fault.kind for fault in first) == sorted(campaign.KINDS)
    assert all(1 <= fault.node < 8 for fault in first)
    others = [campaign.campaign(seed, campaign.KINDS, 8) for seed in range(10)]
    assert any(other != first for other in others)
    assert campaign.campaign(1, [campaign.CRASH], 2) == [campaign.Fault(campaign.CRASH, 1)]
    with pytest.raises(ValueError):
        campaign.campaign(1, [campaign.CRASH], 1)


def event(at: float, kind: str, node: str | None = None, blamed: str | None = None):
    from meshkit.events import Blame, Event, EventKind

    blame = None if blamed is None else Blame(node=blamed)
    return Event(f"id{at}", at, EventKind(kind), "text", node=node, blame=blame)


def test_goodput_judges_the_first_event_of_the_faults_kind_naming_its_node():
    events = [
        event(5.0, "failed", blamed="10.0.0.3"),  # before the fault: not this one
        event(12.0, "failed", blamed="10.0.0.2"),  # another node: an alarm, named wrong
        event(14.0, "failed", blamed="10.0.0.3"),
        event(15.0, "restarted"),
    ]
    judged = campaign.judge(events, campaign.CRASH, "10.0.0.3", 10.0)
    assert judged == campaign.Judgement(14.0, True)
    judged = campaign.judge(events, campaign.POWEROFF, "10.0.0.3", 10.0)
    assert judged == campaign.Judgement(12.0, False)  # noticed, but as a failure, not lost
    assert campaign.judge(events, campaign.HANG, "10.0.0.3", 20.0) == campaign.Judgement(
        None, False
    )
    xid = [event(11.0, "health", node="10.0.0.3"), event(11.0, "evicted", node="10.0.0.3")]
    assert campaign.judge(xid, campaign.XID, "10.0.0.3", 10.0).named_right
    assert campaign.false_alarms([*events, *xid]) == {"failed": 3, "restarted": 1, "evicted": 1}


def test_goodput_reads_where_each_start_resumed_and_the_steps_lost():
    log = "\n".join(
        [
            "no checkpoint at checkpoints/gp0.pt: starting at step 0",
            "checkpoint at step 20 loss=0.1",
            "resumed from step 20 (checkpoints/gp0.pt)",
            "10.0.0.4: resumed from step 40 (checkpoints/gp0.pt)",  # pdsh's prefix
        ]
    )
    assert campaign.resumes(log) == [0, 20, 40]
    assert campaign.steps_lost(57, 40) == 17
    assert campaign.steps_lost(57, None) == 0  # never restarted
    assert campaign.steps_lost(3, 20) == 0


def outcome(system: str, kind: str, done: int, wall: float, step_s: float | None, **kw):
    return campaign.Outcome(system, kind, 1, steps_done=done, wall_s=wall, step_s=step_s, **kw)


def test_goodput_ettr_is_steps_done_at_the_fault_free_pace_over_the_wall_time():
    ran = [
        outcome("meshkit", "crash", 900, 100.0, 0.1),
        outcome("meshkit", "poweroff", 500, 100.0, 0.12),
        outcome("meshkit", "slow", 0, 0.0, None, available=False),
    ]
    assert campaign.fault_free_step_s(ran) == pytest.approx(0.11)
    assert campaign.ettr(ran) == pytest.approx(1400 * 0.11 / 200.0)
    assert campaign.ettr([outcome("elastic", "hang", 0, 50.0, None)]) is None
    # each segment at its own pace: 900 steps at 0.1 s and 500 at 0.12 s, over 200 s
    assert campaign.paced_ettr(ran) == pytest.approx((900 * 0.1 + 500 * 0.12) / 200.0)


def test_goodput_table_has_a_row_per_fault_and_system_then_each_systems_ettr():
    rows = [
        outcome("meshkit", "crash", 900, 100.0, 0.1, detect_s=0.5, running_again_s=8.25,
                steps_lost=7, named_right=True),
        outcome("elastic", "crash", 800, 100.0, 0.1, detect_s=9.0, running_again_s=9.0,
                steps_lost=7),
        outcome("elastic", "xid", 1000, 100.0, 0.1, kept_running=True, steps_lost=0),
        outcome("meshkit", "slow", 0, 0.0, None, available=False),
    ]  # fmt: skip
    lines = campaign.table(rows).splitlines()
    assert lines[0].startswith("| fault (node) | system | detect s |")
    assert lines[2] == "| crash (node 1) | meshkit | 0.5 | 8.2 | 7 | yes |"
    assert lines[3] == "| crash (node 1) | elastic | 9.0 | 9.0 | 7 | no |"
    assert lines[4] == "| xid (node 1) | elastic | never | kept running | 0 | no |"
    assert lines[5] == "| slow (node 1) | meshkit | " + " | ".join(["not available"] * 4) + " |"
    assert lines[9] == "| meshkit | 900 | 100 | 0.100 | 90.0% | 90.0% |"
    assert lines[10] == "| elastic | 1800 | 200 | 0.100 | 90.0% | 90.0% |"


def test_goodput_flags_quick_and_bad_input():
    args = goodput.parse([])
    assert (args.nodes, args.spares, args.fault_free_minutes) == (8, 2, 20.0)
    assert args.fault_list == list(campaign.KINDS)
    assert args.system_list == ["meshkit", "signals-off", "elastic"]
    assert args.out.name == "goodput.json"
    quick = goodput.parse(["--quick"])
    assert (quick.nodes, quick.spares, quick.fault_list) == (3, 1, ["crash", "poweroff"])
    assert quick.fault_free_minutes < 20
    assert goodput.parse(["--quick", "--fault-free-minutes", "0"]).fault_free_minutes == 0
    for bad in (["--faults", "crash,meteor"], ["--systems", "slurm"], ["--nodes", "1"]):
        with pytest.raises(SystemExit):
            goodput.parse(bad)
    words = goodput.train_words(args, "gp0-meshkit", has_work=True).split()
    assert words[0] == "example_train.py" and "--work" in words
    assert "--work" not in goodput.train_words(args, "gp0", has_work=False).split()
