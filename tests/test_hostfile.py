import pytest

from meshkit import hostfile
from meshkit.errors import HostfileError
from meshkit.hostfile import Host, duplicate_problems, parse, select


def test_full_syntax_in_rank_order():
    text = """
    # cluster
    10.0.0.1 slots=4
    alice@10.0.0.2:2222 slots=4   # trailing comment
    [fd00::3]:22 slots=4
    fd00::4 slots=4
    bob@node5 slots=4
    """
    hosts = parse(text)
    assert [h.host for h in hosts] == ["10.0.0.1", "10.0.0.2", "fd00::3", "fd00::4", "node5"]
    assert hosts[1] == Host("10.0.0.2", "alice", 2222, 4, 4)
    assert hosts[2].port == 22
    assert hosts[3].port is None
    assert hosts[4].user == "bob"
    assert hosts[2].label == "[fd00::3]:22"
    assert hosts[1].known_hosts_name() == "[10.0.0.2]:2222"
    assert hosts[2].known_hosts_name() == "fd00::3"


def test_ranges_expand_in_order():
    hosts = parse("gpu[01-03] slots=2\ncpu[1,5]\n".replace("cpu[1,5]", "cpu[1,5] slots=2"))
    assert [h.host for h in hosts] == ["gpu01", "gpu02", "gpu03", "cpu1", "cpu5"]
    assert {h.lineno for h in hosts[:3]} == {1}


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("host:0", "bad port '0'"),
        ("host:70000", "bad port '70000'"),
        ("host:ssh", "bad port 'ssh'"),
        ("host slots=0", "bad slots '0'"),
        ("host slots=x", "bad slots 'x'"),
        ("host gpus=2", "unknown option 'gpus=2'"),
        ("host slots=1 slots=1", "slots= given twice"),
        ("[fd00::1", "'[' without ']'"),
        ("[node1]:22", "is not an IPv6 address"),
        ("host;rm -rf /", "bad host"),
        ("$(reboot)", "bad host"),
        ("bad user@host", "unknown option"),
        ("b`x`@host", "bad user"),
        ("node[05-01]", "bad host range"),
    ],
)
def test_errors_name_the_line_and_the_format(line, needle):
    with pytest.raises(HostfileError) as err:
        parse(f"ok1\n{line}\n", "hf")
    assert "hf:2: " in str(err.value)
    assert needle in str(err.value)


def test_every_problem_is_reported_not_just_the_first():
    with pytest.raises(HostfileError) as err:
        parse("a:0\nb:0\n", "hf")
    assert err.value.problems[0].startswith("hf:1:")
    assert err.value.problems[1].startswith("hf:2:")


def test_empty_file_says_how_to_fix():
    with pytest.raises(HostfileError, match="no hosts; add one line per node"):
        parse("# only a comment\n\n", "hf")


def test_duplicates_by_name_and_port():
    with pytest.raises(HostfileError, match="hf:3: B duplicates line 2"):
        parse("a\nb\nB\n", "hf")
    assert len(parse("a:22\na:2222\n")) == 2


def test_duplicates_after_resolution():
    hosts = parse("node1\n10.0.0.1\nnode2\n")
    problems = duplicate_problems(
        hosts, {"node1": ["10.0.0.1"], "10.0.0.1": ["10.0.0.1"], "node2": ["10.0.0.2"]}, "hf"
    )
    assert problems == [
        "hf:2: 10.0.0.1 is 10.0.0.1, the same node as node1 on line 1; list each node once"
    ]


def test_slots_must_agree():
    with pytest.raises(HostfileError, match="hf:2: slots=4 but line 1 has slots=2"):
        parse("a slots=2\nb slots=4\n", "hf")
    with pytest.raises(HostfileError, match="hf:2: no slots= but line 1 has slots=2"):
        parse("a slots=2\nb\n", "hf")


def test_bounds_on_size():
    with pytest.raises(HostfileError, match="more than 4096"):
        parse("n[0-5000]\n")
    with pytest.raises(HostfileError, match="longer than"):
        parse("a" * 2000 + "\n")
    with pytest.raises(HostfileError, match="more than"):
        parse("\n".join(f"h{i}" for i in range(hostfile.MAX_NODES + 1)))


def test_select_by_names_patterns_and_ranges():
    hosts = parse("node[01-06]\nlogin\n")
    names = lambda hs: [h.host for h in hs]  # noqa: E731
    assert names(select(hosts, include="node[02-03],login")) == ["node02", "node03", "login"]
    assert names(select(hosts, exclude="node0*")) == ["login"]
    assert names(select(hosts, include="node*", exclude="node[01-04]")) == ["node05", "node06"]
    with pytest.raises(HostfileError, match="leave no hosts"):
        select(hosts, include="nothing")


# ---- spare lines: meshed and checked like every node, no rank ----------------------------------


def test_a_spare_line_is_a_node_held_in_reserve():
    hosts = parse("gpu01 slots=8\ngpu17 slots=8 spare\ngpu02 slots=8\ngpu[20-21] spare slots=8\n")
    assert [host.spare for host in hosts] == [False, True, False, True, True]
    assert hosts[1] == Host("gpu17", None, None, 8, 2, spare=True)
    assert {host.lineno for host in hosts[3:]} == {4}  # a range of spares: each one a spare
    active = hostfile.active(hosts)
    assert [host.host for host in active] == ["gpu01", "gpu02"]  # rank order, spares left out
    assert [host.host for host in select(hosts, exclude="gpu0*")] == ["gpu17", "gpu20", "gpu21"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a\nb spare spare\n", "hf:2: spare given twice"),
        ("a\nb spares\n", "unknown option 'spares': the options are slots=N and spare"),
        ("a\nb spare=1\n", "unknown option 'spare=1'"),
        ("a spare\nb spare\n", "hf: every line is a spare; a spare stands in for a node"),
        ("a slots=8\nb spare\n", "hf:2: no slots= but line 1 has slots=8"),
        ("a slots=8\nb slots=4 spare\n", "hf:2: slots=4 but line 1 has slots=8"),
        ("a\nb\nB spare\n", "hf:3: B duplicates line 2"),
    ],
)
def test_spare_lines_are_checked_like_every_line(text, needle):
    """A spare takes a lost node's rank, so its slots must agree and it must be another node;
    a hostfile of spares only stands in for nothing."""
    with pytest.raises(HostfileError) as err:
        parse(text, "hf")
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "line",
    [
        "gpu01",
        "gpu01 slots=8",
        "alice@gpu01:2222 slots=8",
        "10.0.0.2:2222",
        "bob@10.0.0.2",
        "fd00::4 slots=4",
        "carol@fd00::6",
        "[fd00::3]:2222 slots=4",
        "bob@[fd00::5]:22",
    ],
)
def test_a_hosts_line_reads_back_as_the_same_node(line):
    """A membership's hostfile is written with ``Host.line``: users, ports, IPv6 addresses with
    and without a port, and slots come back as they were; a spare's line drops ``spare``."""
    host = parse(line)[0]
    assert host.line() == line
    assert parse(host.line()) == [host]
    slots = f" slots={host.slots}" if host.slots else ""
    spare = parse(f"other{slots}\n{line} spare\n")[1]
    assert spare.spare
    assert spare.line() == line
    assert parse(spare.line()) == [host]


def test_members_text_is_a_hostfile_of_exactly_the_members_in_rank_order():
    hosts = parse("a slots=2\nbob@b:2222 slots=2\nc slots=2\n[fd00::9]:22 slots=2 spare\n")
    members = [hosts[0], hosts[3], hosts[2]]  # b lost, the spare took its rank
    text = hostfile.members_text(members)
    assert text.endswith("\n")
    assert text.startswith("# ")  # says what it is
    again = parse(text)
    assert [host.label for host in again] == ["a", "[fd00::9]:22", "c"]
    assert [host.line() for host in again] == [host.line() for host in members]
    assert not any(host.spare for host in again)  # every member takes a rank


@pytest.mark.parametrize(
    "line",
    [
        "fe80::1%$(touch_x)",
        "[fe80::1%a;b]:2222",
        "fe80::1%a\x1bb",
        "fe80::1%a'b",
        "fe80::1%" + "a" * 65,
    ],
)
def test_an_ipv6_scope_id_is_an_interface_name_or_number(line):
    """Python's ipaddress takes any text after '%'; the host goes into ssh's and the nodes'
    commands, so a zone is letters, digits, '_', '.' and '-' only."""
    with pytest.raises(HostfileError, match="bad IPv6 scope id"):
        parse(line + "\n")


def test_ipv6_scope_ids_that_name_interfaces_are_kept():
    hosts = parse("fe80::1%eth0\n[fe80::2%enp1s0.100]:2222\nfe80::3%3\n")
    assert [host.host for host in hosts] == ["fe80::1%eth0", "fe80::2%enp1s0.100", "fe80::3%3"]


def test_a_nodes_rank_is_found_by_its_label_as_the_hostfile_spells_it():
    hosts = parse("alice@node1:2222\nnode2\nnode3 spare\n")
    assert hostfile.rank_of(hosts, "node1:2222") == 0  # its label: host and port, no user
    assert hostfile.rank_of(hosts, "node2") == 1
    assert hostfile.rank_of(hosts, "node1") is None  # another spelling is not its label
    assert hostfile.rank_of(hosts, "node9") is None
