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
