import pytest

from meshkit.hostfile import parse
from meshkit.topology import (
    Interface,
    LocalAddress,
    TopologyError,
    derive_master_port,
    interface_by_route,
    interface_of_match,
    match_rank,
    socket_ifnames,
    spare_match,
    usable,
)

HOSTS = parse("10.0.0.1\n10.0.0.2\nnode3\n[fd00::4]:22\n")
RESOLVED = [["10.0.0.1"], ["10.0.0.2"], ["10.0.0.3"], ["fd00::4"]]


def node(*addrs):
    return [LocalAddress("lo", "127.0.0.1"), LocalAddress("docker0", "172.17.0.1"), *addrs]


@pytest.mark.parametrize(
    ("addr", "rank"),
    [("10.0.0.1", 0), ("10.0.0.2", 1), ("10.0.0.3", 2), ("fd00:0::4", 3)],
)
def test_each_node_finds_its_own_rank(addr, rank):
    match = match_rank(HOSTS, RESOLVED, node(LocalAddress("eth0", addr)), "whatever")
    assert (match.rank, match.interface) == (rank, "eth0")


def test_docker_bridge_address_never_decides():
    hosts = parse("172.17.0.1\n10.0.0.2\n")
    match = match_rank(
        hosts, [["172.17.0.1"], ["10.0.0.2"]], node(LocalAddress("eth0", "10.0.0.2")), "n2"
    )
    assert match.rank == 1
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


def test_a_spare_line_is_matched_by_address_then_by_hostname():
    spares = parse("10.0.0.1\n10.0.0.8 spare\ngpu9 spare\n")[1:]
    resolved = [["10.0.0.8"], ["10.0.0.9"]]
    assert spare_match(spares, resolved, node(LocalAddress("eth0", "10.0.0.9")), "x") == spares[1]
    assert spare_match(spares, [[], []], node(), "gpu9.cluster.local") == spares[1]
    assert spare_match(spares, resolved, node(LocalAddress("eth0", "10.0.0.2")), "x") is None
    assert spare_match([], [], node(LocalAddress("eth0", "10.0.0.8")), "gpu9") is None


def test_hostname_fallback_when_no_address_matches():
    hosts = parse("alpha\nbeta\n")
    match = match_rank(
        hosts, [[], []], node(LocalAddress("eth0", "10.9.9.9")), "beta.cluster.local"
    )
    assert (match.rank, match.interface) == (1, "hostname")


def test_single_localhost_line_is_rank_zero():
    match = match_rank(parse("localhost\n"), [["127.0.0.1", "::1"]], node(), "box")
    assert match.rank == 0


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
    assert "matches no line" in str(err.value)
    assert "MESHKIT_NODE_RANK" in str(err.value)
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


# -- GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME -----------------------------------------------------


def test_interface_is_the_one_whose_address_placed_this_node():
    match = match_rank(HOSTS, RESOLVED, node(LocalAddress("ens3", "10.0.0.2")), "n2")
    chosen = interface_of_match(match)
    assert chosen is not None
    assert (chosen.name, chosen.address) == ("ens3", "10.0.0.2")
    assert chosen.reason == "hostfile: 10.0.0.2 on ens3 placed this node"
    # a hostname match names no address, so no interface: the route decides instead
    by_name = match_rank(parse("alpha\nbeta\n"), [[], []], node(), "beta")
    assert interface_of_match(by_name) is None


def test_debian_127_0_1_1_line_never_decides_a_rank_or_an_interface():
    # node0 resolves to 127.0.1.1 first on node0 itself (Debian's /etc/hosts), then its address
    hosts = parse("node0\nnode1\n")
    local = node(LocalAddress("eno1", "10.0.0.1"))
    match = match_rank(hosts, [["127.0.1.1", "10.0.0.1"], ["10.0.0.2"]], local, "node0")
    assert (match.rank, match.interface, match.address) == (0, "eno1", "10.0.0.1")
    # only 127.0.1.1: the hostname places the node, but no interface comes from loopback
    match = match_rank(hosts, [["127.0.1.1"], ["10.0.0.2"]], local, "node0")
    assert (match.rank, match.interface) == (0, "hostname")
    chosen = interface_by_route("node0", [("127.0.1.1", "127.0.0.1")], local, nnodes=2)
    assert chosen.name is None
    assert "127.0.1.1: loopback" in chosen.reason
    assert "GLOO_SOCKET_IFNAME" in chosen.reason
    # a name resolving to loopback, listed twice, is not two matches of this machine
    with pytest.raises(TopologyError, match="matches no line"):
        match_rank(hosts, [["127.0.1.1"], ["127.0.1.1"]], local, "other")


def test_scheduler_sources_take_the_interface_that_reaches_master_addr():
    local = node(LocalAddress("eth0", "10.0.0.2"), LocalAddress("ib0", "192.168.5.2"))
    chosen = interface_by_route(
        "gpu01", [("127.0.1.1", "127.0.0.1"), ("192.168.5.1", "192.168.5.2")], local, nnodes=4
    )
    assert (chosen.name, chosen.address) == ("ib0", "192.168.5.2")
    assert (
        chosen.reason == "route: MASTER_ADDR gpu01 (192.168.5.1) is reached from 192.168.5.2 on ib0"
    )
    none = interface_by_route("gpu01", [("10.9.9.9", None)], local, nnodes=4)
    assert none.name is None
    assert "10.9.9.9: no route" in none.reason
    assert interface_by_route("x", [], local, 2).reason.startswith("none:")
    # a one-node job on loopback is fine
    assert interface_by_route("localhost", [("127.0.0.1", "127.0.0.1")], local, 1).name == "lo"


def test_user_settings_are_kept_and_fill_only_what_is_missing():
    chosen = Interface("eno1", "10.0.0.1", "hostfile: 10.0.0.1 on eno1 placed this node")
    filled = socket_ifnames(chosen, {})
    assert filled.variables == {"GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "eno1"}
    assert filled.reason == chosen.reason
    kept = socket_ifnames(chosen, {"NCCL_SOCKET_IFNAME": "^docker0,lo"})
    assert kept.variables == {"GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "^docker0,lo"}
    assert kept.reason == f"NCCL_SOCKET_IFNAME already set: kept; {chosen.reason}"
    none_found = socket_ifnames(Interface(None, None, "none: no route"), {})
    assert none_found.variables == {}
    assert none_found.reason == "none: no route"
