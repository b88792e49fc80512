import dataclasses
import shlex
import subprocess

import pytest

from meshkit.distenv import (
    VARIABLES,
    DistEnvError,
    NodeEnv,
    as_json,
    combine,
    export_lines,
    process_place,
    variables,
)
from meshkit.hostfile import parse
from meshkit.sources import Placement
from meshkit.topology import Match

HOSTS = parse("10.0.0.1 slots=2\n10.0.0.2 slots=2\n10.0.0.3 slots=2\n")


def env_for(rank, **kw):
    return combine(
        None,
        HOSTS,
        Match(rank, f"10.0.0.{rank + 1}", "eth0"),
        session="s",
        master_port=kw.get("port"),
        nproc_per_node=kw.get("nproc"),
        gpu_count=lambda: 0,
    )


def test_every_simulated_node_agrees_on_everything_but_its_rank():
    envs = [env_for(r) for r in range(3)]
    assert [e.node_rank for e in envs] == [0, 1, 2]
    assert len({(e.nnodes, e.master_addr, e.master_port, e.nproc_per_node) for e in envs}) == 1
    assert envs[0].master_addr == "10.0.0.1" and envs[0].world_size == 6


def test_precedence_flag_then_launcher_then_hostfile_then_gpus():
    assert env_for(0, port=29500, nproc=8).master_port == 29500
    assert env_for(0, nproc=8).nproc_per_node == 8
    no_slots = parse("a\nb\n")
    e = combine(
        None,
        no_slots,
        Match(1, "b", "eth0"),
        session="s",
        master_port=None,
        nproc_per_node=None,
        gpu_count=lambda: 4,
    )
    assert e.nproc_per_node == 4
    e = combine(
        None,
        no_slots,
        Match(1, "b", "eth0"),
        session="s",
        master_port=None,
        nproc_per_node=None,
        gpu_count=lambda: 0,
    )
    assert e.nproc_per_node == 1
    slurm = Placement(
        "slurm", 1, nnodes=2, master_addr="gpu07", master_port=None, nproc_per_node=None
    )
    e = combine(
        slurm, None, None, session="s", master_port=None, nproc_per_node=None, gpu_count=lambda: 2
    )
    assert (e.master_addr, e.nnodes, e.nproc_per_node, e.source) == ("gpu07", 2, 2, "slurm")


def test_rank_outside_node_count_is_an_error():
    with pytest.raises(DistEnvError, match=r"outside 0\.\.2"):
        combine(
            Placement("explicit", 5),
            HOSTS,
            None,
            session="s",
            master_port=None,
            nproc_per_node=None,
            gpu_count=lambda: 0,
        )


def test_exports_are_eval_safe_and_complete():
    e = NodeEnv(0, 1, "host'; touch /tmp/pwned; '", 1234, 1, "explicit", "x")
    out = subprocess.run(
        ["bash", "-c", export_lines(e) + '\nprintf %s "$MASTER_ADDR"'],
        capture_output=True,
        text=True,
    )
    assert out.stdout == "host'; touch /tmp/pwned; '"
    e = dataclasses.replace(
        e, socket_ifnames=(("GLOO_SOCKET_IFNAME", "ens3"), ("NCCL_SOCKET_IFNAME", "ens3"))
    )
    assert list(variables(e)) == list(VARIABLES)
    assert set(as_json(e)) == {*VARIABLES, "source", "matched", "interface_source"}
    assert shlex.split(export_lines(env_for(1)).splitlines()[0]) == ["export", "NODE_RANK=1"]
    v = variables(env_for(2))
    assert (v["PET_NODE_RANK"], v["PET_NNODES"], v["PET_NPROC_PER_NODE"], v["WORLD_SIZE"]) == (
        "2",
        "3",
        "2",
        "6",
    )
    assert v["GPUS_PER_NODE"] == v["NPROC_PER_NODE"] == "2"


def test_process_place_from_each_launcher():
    e = env_for(1)
    assert process_place(e, {"RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}).rank == 3
    assert (
        process_place(e, {"SLURM_PROCID": "4", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0"}).rank == 4
    )
    assert process_place(e, {}).rank == 2 and process_place(e, {"LOCAL_RANK": "1"}).rank == 3
