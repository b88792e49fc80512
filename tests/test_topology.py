import pytest

from meshkit.hostfile import parse
from meshkit.topology import LocalAddress, TopologyError, derive_master_port, match_rank, usable

HOSTS = parse("10.0.0.1\n10.0.0.2\nnode3\n[fd00::4]:22\n")
RESOLVED = [["10.0.0.1"], ["10.0.0.2"], ["10.0.0.3"], ["fd00::4"]]


def node(*addrs):
    return [LocalAddress("lo", "127.0.0.1"), LocalAddress("docker0", "172.17.0.1"), *addrs]


@pytest.mark.parametrize(
    ("addr", "rank"),
    [("10.0.0.1", 0), ("10.0.0.2", 1), ("10.0.0.3", 2), ("fd00:0::4", 3)],
)
def test_each_node_finds_its_own_rank(addr, rank):
    m = match_rank(HOSTS, RESOLVED, node(LocalAddress("eth0", addr)), "whatever")
    assert (m.rank, m.interface) == (rank, "eth0")


def test_docker_bridge_address_never_decides():
    hosts = parse("172.17.0.1\n10.0.0.2\n")
    m = match_rank(
        hosts, [["172.17.0.1"], ["10.0.0.2"]], node(LocalAddress("eth0", "10.0.0.2")), "n2"
    )
    assert m.rank == 1
    with pytest.raises(TopologyError, match="matches no line"):
        match_rank(
            hosts, [["172.17.0.1"], ["10.0.0.9"]], node(LocalAddress("eth0", "10.0.0.2")), "n2"
        )


def test_loopback_and_link_local_are_ignored():
    local = [
        LocalAddress("lo", "127.0.0.1"),
        LocalAddress("eth0", "fe80::1%eth0"),
        LocalAddress("eth0", "10.1.1.1"),
    ]
    assert [a.address for a in usable(local)] == ["10.1.1.1"]


def test_hostname_fallback_when_no_address_matches():
    hosts = parse("alpha\nbeta\n")
    m = match_rank(hosts, [[], []], node(LocalAddress("eth0", "10.9.9.9")), "beta.cluster.local")
    assert (m.rank, m.interface) == (1, "hostname")


def test_single_localhost_line_is_rank_zero():
    m = match_rank(parse("localhost\n"), [["127.0.0.1", "::1"]], node(), "box")
    assert m.rank == 0


def test_two_matching_lines_is_an_error_listing_both_sides():
    with pytest.raises(TopologyError) as err:
        match_rank(
            HOSTS,
            RESOLVED,
            node(LocalAddress("eth0", "10.0.0.1"), LocalAddress("eth1", "10.0.0.2")),
            "h",
            "hf",
        )
    text = str(err.value)
    assert "matches 2 lines" in text
    assert "local addresses: lo=127.0.0.1, docker0=172.17.0.1, eth0=10.0.0.1, eth1=10.0.0.2" in text
    assert "hostfile addresses: 10.0.0.1=10.0.0.1, 10.0.0.2=10.0.0.2, node3=10.0.0.3" in text


def test_no_match_lists_addresses_and_the_fix():
    with pytest.raises(TopologyError) as err:
        match_rank(HOSTS, RESOLVED, node(LocalAddress("eth0", "10.0.0.99")), "stranger", "hf")
    assert "matches no line" in str(err.value) and "MESHKIT_NODE_RANK" in str(err.value)
    assert "eth0=10.0.0.99" in str(err.value)


def test_master_port_is_the_same_everywhere_and_varies_with_session_and_nodes():
    ports = {derive_master_port(parse("10.0.0.1\n10.0.0.2\n"), "train") for _ in range(3)}
    assert len(ports) == 1
    port = ports.pop()
    assert 20000 <= port < 30000
    # comments and spacing do not move it; the session and the nodes do
    assert derive_master_port(parse("# x\n10.0.0.1   \n10.0.0.2\n"), "train") == port
    assert derive_master_port(parse("10.0.0.1\n10.0.0.2\n"), "other") != port
    assert derive_master_port(parse("10.0.0.1\n10.0.0.3\n"), "train") != port
