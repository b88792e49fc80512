"""A job's history (issue 44, items 7 and 8), without a sandbox: the node's store (append,
rotation, bounded reads, since and limit, damaged lines, no link followed), ``tell`` and
``history`` over several nodes, the merge, the ``--notify`` command's runner, ``--notify-on``,
and how ``meshkit events`` shows node text."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from meshkit import protocol as p
from meshkit.cli.tasks import events as cli_events
from meshkit.errors import UsageError
from meshkit.events import Blame, Event, EventKind, merge
from meshkit.hostfile import Host
from meshkit.job import Job
from meshkit.node import events as store
from meshkit.ops import events as ops
from meshkit.ops.lookup import notify_on_flag
from meshkit.ops.notify import Notifier
from meshkit.outcome import Outcome
from meshkit.record import replace

HOSTS = [Host("10.0.0.1", lineno=1), Host("10.0.0.2", lineno=2), Host("10.0.0.3", lineno=3)]


def job_in(tmp_path: Path) -> Job:
    return Job("true", str(tmp_path / "work"), "s", str(tmp_path / "hostfile"), "/p", 1)


def event(when: float, kind: EventKind = EventKind.LAUNCHED, text: str = "x") -> Event:
    return Event(id=os.urandom(8).hex(), time=when, kind=kind, text=text)


def add(home: str, *events: Event) -> None:
    store.events(p.EventsRequest("ab" * 8, home, add=list(events)))


def read(home: str, since: float = 0.0, limit: int = 1000) -> p.EventsReply:
    return store.events(p.EventsRequest("ab" * 8, home, since=since, limit=limit))


# ---- the node's store


def test_events_are_appended_privately_and_read_back_oldest_first(tmp_path):
    home = str(tmp_path / "home")
    later = event(2000.0, EventKind.STOPPED)
    first = event(1000.0)
    add(home, later)
    add(home, first)
    assert read(home).events == [first, later]
    directory = tmp_path / "home" / "events"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (only,) = directory.iterdir()
    assert only.name == store.this_node()
    assert stat.S_IMODE(only.stat().st_mode) == 0o600
    assert len(only.read_text().splitlines()) == 2
    # adding returns nothing unless asked; since None asks for nothing
    assert store.events(p.EventsRequest("ab" * 8, home, add=[event(3.0)])).events == []


def test_since_and_limit_and_more(tmp_path):
    home = str(tmp_path)
    found = [event(float(when)) for when in range(100, 110)]
    add(home, *found)
    assert read(home, since=105).events == found[5:]
    page = read(home, since=0, limit=3)
    assert page.events == found[:3]
    assert page.more
    assert not read(home, since=0, limit=10).more


def test_a_damaged_line_is_skipped(tmp_path):
    home = str(tmp_path)
    good = event(100.0)
    add(home, good)
    path = tmp_path / "events" / store.this_node()
    with path.open("ab") as out:
        out.write(b"not json\n\xff\xfe\n[1, 2]\n")
        out.write(b'{"id": "x", "time": 200.0, "kind": "no such kind", "text": ""}\n')
        out.write(b'{"id": "y", "time": 1e400, "kind": "launched", "text": ""}\n')
        out.write(b'{"id": "z", "time": 300.0, "kind": "done"')  # cut off mid-line
    last = event(400.0, EventKind.DONE)
    add(home, last)
    assert read(home).events == [good, last]


def test_the_file_rotates_and_the_history_stays_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "ROTATE_BYTES", 2000)
    home = str(tmp_path)
    written = [event(float(when), text="y" * 100) for when in range(200)]
    for one in written:
        add(home, one)
    files = sorted(path.name for path in (tmp_path / "events").iterdir())
    assert files == [store.this_node(), f"{store.this_node()}.1"]
    assert all(path.stat().st_size < 2000 + 400 for path in (tmp_path / "events").iterdir())
    kept = read(home).events
    assert 10 < len(kept) < 60
    assert kept == written[-len(kept) :]  # the newest, in order, none lost between the two


def test_no_link_is_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    (home / "events").symlink_to(elsewhere)
    with pytest.raises(store.UnsafeEvents, match="rm -rf"):
        add(str(home), event(1.0))
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(store.UnsafeEvents):
        read(str(home))
    # a link at the file's name: neither written through nor read
    (home / "events").unlink()
    (home / "events").mkdir(mode=0o700)
    target = tmp_path / "target"
    target.write_text("")
    (home / "events" / store.this_node()).symlink_to(target)
    with pytest.raises(OSError):
        add(str(home), event(1.0))
    assert target.read_text() == ""
    target.write_text(json.dumps(store.asdict(event(5.0))) + "\n")
    assert read(str(home)).events == []


def test_an_events_directory_others_can_write_is_refused(tmp_path):
    home = tmp_path / "home"
    (home / "events").mkdir(parents=True)
    (home / "events").chmod(0o777)
    with pytest.raises(store.UnsafeEvents, match="another user could write it"):
        add(str(home), event(1.0))


def test_every_nodes_file_is_read_and_merged_by_id(tmp_path, monkeypatch):
    home = str(tmp_path)
    shared = event(50.0)
    for name in ("node0", "node1"):
        monkeypatch.setattr(store, "this_node", lambda name=name: f"{name}.jsonl")
        add(home, shared, event(60.0, text=name))
    found = read(home).events
    assert found[0] == shared
    assert sorted(one.text for one in found[1:]) == ["node0", "node1"]


def test_a_reply_fits_a_line_and_a_huge_event_is_trimmed(tmp_path):
    home = str(tmp_path)
    blame = Blame(node="n", log=["z" * 1000] * 200)
    huge = replace(event(1.0), text="t" * 100_000, blame=blame)
    add(home, huge)
    (kept,) = read(home).events
    assert kept.id == huge.id
    assert kept.blame is not None
    assert kept.blame.log == []
    assert len(kept.text) == store.TRIMMED_TEXT
    many = [event(float(when), text="w" * 30_000) for when in range(2, 40)]
    add(home, *many)
    reply = read(home)
    assert reply.more
    assert len(p.encode_reply(reply)) < p.MAX_LINE


def test_merge_keeps_each_event_once_oldest_first():
    first = event(1.0)
    second = event(2.0)
    third = event(3.0)
    assert merge([[third, first], [second, first], []]) == [first, second, third]


# ---- over the nodes: tell and history


class StorePool:
    """Each node answers the ``events`` op from its own directory under ``root`` (storage
    not shared), by the real node handler; a node in ``failures`` answers nothing."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.failures: dict[Host, str] = {}
        self.requests = 0

    def call_all(
        self,
        phase: str,
        request_for: Callable[[Host], p.Request | None],
        expect: type,
        hosts: Sequence[Host] | None = None,
        timeout: float | None = None,
    ) -> dict[Host, Outcome[p.EventsReply]]:
        out = {}
        for host in hosts or HOSTS:
            if host in self.failures:
                continue
            request = request_for(host)
            assert isinstance(request, p.EventsRequest)
            self.requests += 1
            mine = replace(request, home=f"{self.root}/{host.host}{request.home}")
            mine_name = f"{host.host}.jsonl"
            self.monkeypatch.setattr(store, "this_node", lambda name=mine_name: name)
            out[host] = Outcome(store.events(mine))
        return out


def test_tell_keeps_events_on_every_node_that_answers_and_history_merges(tmp_path, monkeypatch):
    job = job_in(tmp_path)
    pool = StorePool(tmp_path / "nodes", monkeypatch)
    monkeypatch.setattr(ops, "cluster_hosts", lambda job: HOSTS)
    launched = ops.new_event(job, EventKind.LAUNCHED, "train started", by="train")
    assert launched.generation == job.generation
    assert launched.launch == job.launch
    assert abs(launched.time - time.time()) < 5
    pool.failures = {HOSTS[2]: "No route to host"}
    assert ops.tell(pool, job, HOSTS, [launched]) == HOSTS[:2]  # type: ignore[arg-type]
    pool.failures = {}
    failed = ops.new_event(job, EventKind.FAILED, "rank 3 failed", node="10.0.0.2", rank=1)
    assert ops.tell(pool, job, HOSTS, [failed]) == HOSTS  # type: ignore[arg-type]
    # node 0 (the leader, the master) is off: the others have the whole history
    pool.failures = {HOSTS[0]: "timed out"}
    found = ops.history(pool, job, HOSTS)  # type: ignore[arg-type]
    assert found.events == [launched, failed]
    assert found.failures == {HOSTS[0]: "unreachable: timed out"}
    assert ops.history(pool, job, HOSTS, since=failed.time).events == [failed]  # type: ignore[arg-type]


def test_history_pages_until_a_node_has_no_more(tmp_path, monkeypatch):
    job = job_in(tmp_path)
    pool = StorePool(tmp_path / "nodes", monkeypatch)
    monkeypatch.setattr(ops, "PAGE", 7)
    many = [ops.new_event(job, EventKind.ATTEMPT, f"attempt {n}") for n in range(30)]
    many = [replace(one, time=1000.0 + n) for n, one in enumerate(many)]
    ops.tell(pool, job, HOSTS[:1], many)  # type: ignore[arg-type]
    found = ops.history(pool, job, HOSTS[:1])  # type: ignore[arg-type]
    assert found.events == many
    # events sharing one time past a page end the paging instead of repeating it
    same = [replace(one, time=5000.0) for one in many[:20]]
    ops.tell(pool, job, HOSTS[1:2], same)  # type: ignore[arg-type]
    assert len(ops.history(pool, job, HOSTS[1:2]).events) >= 7  # type: ignore[arg-type]
    assert pool.requests < 40


def test_tell_splits_what_does_not_fit_one_request(tmp_path):
    job = job_in(tmp_path)
    big = [ops.new_event(job, EventKind.HEALTH, "h" * 60_000) for _ in range(10)]
    runs = ops.batches(big)
    assert len(runs) > 1
    assert [one for run in runs for one in run] == big
    for run in runs:
        line = p.encode_request(p.EventsRequest(job.id, str(job.home), add=run))
        assert len(line) < p.MAX_LINE


# ---- --notify


def notify_json(tmp_path: Path, kind: EventKind = EventKind.FAILED) -> Event:
    return replace(event(time.time(), kind, text="rank 3 on node2 failed"), rank=3, node="node2")


def test_the_notify_command_gets_the_event_as_json_on_stdin(tmp_path):
    out = tmp_path / "told"
    failures: list[Event] = []
    notifier = Notifier(f"cat >> {out}", ["failed", "done"], 10.0, failures.append)
    told = notify_json(tmp_path)
    notifier.tell(told)
    notifier.tell(replace(told, kind=EventKind.ATTEMPT))  # not a kind it is told of
    notifier.tell(replace(told, kind=EventKind.DONE, id="d" * 16))
    notifier.close(10.0)
    lines = out.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        told.as_json(),
        replace(told, kind=EventKind.DONE, id="d" * 16).as_json(),
    ]
    assert json.loads(lines[0])["kind"] == "failed"
    assert failures == []


def test_a_failing_or_hanging_command_is_an_event_and_the_caller_never_waits(tmp_path):
    failures: list[Event] = []
    failing = Notifier("cat >/dev/null; echo first >&2; echo 'no webhook' >&2; exit 3",
                       ["failed"], 5.0, failures.append)  # fmt: skip
    failing.tell(notify_json(tmp_path))
    failing.close(10.0)
    (said,) = failures
    assert said.kind == EventKind.NOTIFY_FAILED
    assert said.text == "--notify failed for the failed event of node2: exit 3: no webhook"
    failures.clear()
    hanging = Notifier("sleep 60", ["failed", "notify_failed"], 1.0, failures.append)
    began = time.monotonic()
    for _ in range(5):
        hanging.tell(notify_json(tmp_path))
    hanging.tell(said)  # a notify_failed event is never itself notified
    assert time.monotonic() - began < 0.5
    hanging.close(1.5)
    assert time.monotonic() - began < 5
    assert failures
    assert failures[0].text == "--notify failed for the failed event of node2: timed out after 1s"
    assert all(failure.kind == EventKind.NOTIFY_FAILED for failure in failures)


def test_a_command_that_cannot_start_or_a_failing_report_changes_nothing(tmp_path, monkeypatch):
    def broken(failure: Event) -> None:
        raise RuntimeError("the report failed")

    monkeypatch.setenv("PATH", str(tmp_path))  # no bash to be found
    notifier = Notifier("true", ["failed"], 5.0, broken)
    notifier.tell(notify_json(tmp_path))
    notifier.close(5.0)
    assert notifier.run(notify_json(tmp_path)) == (
        "could not start bash: No such file or directory"
    )


def test_notify_on_takes_a_comma_list_of_kinds():
    assert notify_on_flag("failed, done,evicted") == ("failed", "done", "evicted")
    assert notify_on_flag(None) is None
    for bad in ("failure", "", " , ", "failed,nope"):
        with pytest.raises(UsageError, match="--notify-on"):
            notify_on_flag(bad)


# ---- meshkit events: what it shows


def test_the_table_shows_node_text_safely_and_since_is_checked():
    sneaky = replace(
        event(0.0, EventKind.FAILED, text="rank 1 \x1b[2Jfailed\nsecond line\x07"), rank=1
    )
    shown = cli_events.render([sneaky])
    assert "\x1b" not in shown
    assert "\x07" not in shown
    assert "1970-01-01 00:00:00" in shown
    assert shown.splitlines()[0].split() == [
        "time", "(UTC)", "kind", "node", "rank", "gen", "attempt", "detail"
    ]  # fmt: skip
    assert len(shown.splitlines()) == 2
    assert cli_events.render([]) == "no events"
    since = cli_events.since_flag("1h")
    assert since is not None
    assert abs(since - (time.time() - 3600)) < 5
    assert cli_events.since_flag(None) is None
    with pytest.raises(UsageError, match="--since"):
        cli_events.since_flag("yesterday")


def test_follow_shows_each_event_once_as_it_comes(tmp_path, monkeypatch):
    job = job_in(tmp_path)
    pool = StorePool(tmp_path / "nodes", monkeypatch)
    monkeypatch.setattr(ops, "POLL", 0.0)
    first = ops.new_event(job, EventKind.LAUNCHED, "train started")
    ops.tell(pool, job, HOSTS, [first])  # type: ignore[arg-type]
    rounds = ops.follow(pool, job, HOSTS)  # type: ignore[arg-type]
    assert next(rounds).events == [first]
    assert next(rounds).events == []
    late = replace(ops.new_event(job, EventKind.DONE, "done"), time=first.time - 10)
    ops.tell(pool, job, HOSTS[1:], [late])  # type: ignore[arg-type]
    assert next(rounds).events == [late]  # written late, with a clock behind: still shown
    assert next(rounds).events == []
