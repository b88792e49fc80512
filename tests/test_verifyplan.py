"""The N x N check's pure logic, without mocks: the verify script (both names, one login per
pair), its output parsed into one failure per pair, the matrix and the count of good pairs."""

from __future__ import annotations

from meshkit import verifyplan as vp
from meshkit.hostfile import Host


def test_verify_script_by_both_names_and_one_failure_per_pair():
    hosts = [Host("a"), Host("b", user="u", port=2200), Host("c")]
    own = {hosts[0]: "a", hosts[1]: "nodeb", hosts[2]: "nodec"}
    script = vp.verify_script(hosts, 5, start=1, own_hostnames=own)
    assert "check 1 ssh" in script
    assert "-p 2200 -l u -- b true" in script
    assert "keycheck 1h ssh" in script
    assert "-- nodeb true" in script
    # one full login per pair (by the hostfile spelling); by hostname the host key alone
    assert script.count("PreferredAuthentications=none") == 2
    assert "PreferredAuthentications=none -p 2200 -l u -- nodeb" in script
    assert "-- a true" in script
    assert "check 0h" not in script  # hostname == hostfile spelling
    assert script.index("-- b true") < script.index("-- c true") < script.index("-- a true")
    out = (
        "ok 0\nfail 1 Permission denied (publickey).\nfail 1h Host key verification failed.\nok 2\n"
    )
    failures = vp.parse_verify(hosts[0], hosts, out, own)
    assert [(f.target.host, f.error) for f in failures] == [
        (
            "b",
            "Permission denied (publickey).; Host key verification failed. "
            "(host key by hostname nodeb)",
        ),
        ("c", "no result (host key by hostname nodec)"),
    ]
    grid = vp.matrix(hosts, failures)
    assert grid.splitlines()[1].split()[-3:] == [".", "X", "X"]
    assert vp.VerifyResult(hosts, failures).ok_pairs == 7
