"""The mesh variants, each on a fresh cluster after its own floor: meshkit with and without its
NxN verify, Ansible, a parallel bash with ControlMaster and the seed's sequential script; each
end state checked with ``meshkit check``."""

from __future__ import annotations

import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from meshkit import sandbox

from . import cluster, peers, stats
from .cluster import Checked, check_pairs, floor, logins, names, reset_logs, ssh, up
from .harness import StepFailed, bound, must
from .measurement import Options, Row, count_floor_shells

SEED_COLLECT = (
    "test -f ~/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519; "
    "cat ~/.ssh/id_ed25519.pub"
)


def seed(lay: sandbox.Layout) -> None:
    """The pssh-style script: collect each key with one login per node, then one login per key per
    node, all sequential (as the seed does), appending blindly."""
    pubs = [must(ssh(lay, n, SEED_COLLECT), 180).strip() for n in lay.nodes]
    for node in lay.nodes:
        for pub in pubs:
            must(ssh(lay, node, f"echo {shlex.quote(pub)} >> ~/.ssh/authorized_keys"), 180)


def mesh_variants(row: Row, opt: Options, repeat: int) -> sandbox.Layout | None:
    """Each variant on a fresh cluster. Returns the last cluster when it is meshkit's
    ``--no-verify`` one and reached its end state (at large N, the only variant): the ops reuse
    it instead of building and meshing another, which at 244 nodes takes minutes."""
    n = row.nodes
    small = n <= opt.peers_max
    variants: list[tuple[str, Callable[[sandbox.Layout], object], str | None]] = [
        (
            "meshkit_no_verify",
            lambda lay: must(
                [*cluster.MESHKIT, "mesh", "--hostfile", str(lay.hostfile), "--no-verify"], bound(n)
            ),
            None,
        ),
        (
            "meshkit",
            lambda lay: must(
                [*cluster.MESHKIT, "mesh", "--hostfile", str(lay.hostfile)], bound(n, per_pair=1.0)
            ),
            None if n <= opt.n2_max else f"N² verify above --n2-max {opt.n2_max}",
        ),
        (
            "bash_controlmaster",
            mesh_bash,
            None if small else f"peers only up to --peers-max {opt.peers_max}",
        ),
        (
            "ansible",
            lambda lay: mesh_ansible(lay, opt),
            opt.unavailable.get("ansible-core")
            or (None if small else f"peers only up to --peers-max {opt.peers_max}"),
        ),
        (
            "seed",
            seed,
            None
            if n <= min(opt.seed_max, opt.peers_max)
            else f"N + N² sequential logins; only up to --seed-max {opt.seed_max}",
        ),
    ]
    meshed: sandbox.Layout | None = None
    for tool, fn, why in variants:
        if f"mesh/{tool}" in opt.without:
            why = "left out with --without"
        if why:
            row.skip("mesh", tool, why)
            continue
        lay = up(n)
        meshed = None
        row.on(lay, f"r{repeat + 1}/mesh/{tool}")
        row.sample("round", "floor", lambda: floor(lay))  # noqa: B023
        count_floor_shells(row, lay)
        reset_logs(lay)

        # Controller logins are counted before the end-state check adds its own.
        def count() -> None:
            row.logins.setdefault(f"mesh/{tool}", []).append(logins(lay))  # noqa: B023

        if tool == "seed":
            # The seed exchanges no host keys: its end state is recorded, not required.
            row.sample("mesh", tool, lambda: fn(lay), after=count)  # noqa: B023
            row.end_state.setdefault("mesh/seed", []).append(seed_end_state(lay, opt.n2_max))
        elif tool == "ansible":
            # Ansible's mesh plus a separate all-pairs check (what a user of it would run to
            # know the mesh works; meshkit's mesh verifies in the same command): the check's
            # time on the same cluster, added as its own sample.
            took: list[float] = []

            def timed_check() -> Checked:
                start = time.perf_counter()
                checked = check_pairs(lay, opt.n2_max)  # noqa: B023
                took.append(time.perf_counter() - start)  # noqa: B023
                return checked

            row.sample("mesh", tool, lambda: fn(lay), timed_check, count)  # noqa: B023
            mesh_s = row.raw["mesh/ansible"][-1]
            mesh_and_check = None
            if mesh_s is not None and took and lay.count <= opt.n2_max:
                mesh_and_check = round(mesh_s + took[0], 4)
            row.add(stats.ANSIBLE_CHECK, mesh_and_check)
        else:
            row.sample(
                "mesh",
                tool,
                lambda: fn(lay),  # noqa: B023
                lambda: check_pairs(lay, opt.n2_max),  # noqa: B023
                count,
            )
            if tool == "meshkit_no_verify" and row.raw[f"mesh/{tool}"][-1] is not None:
                meshed = lay
    return meshed


def seed_end_state(lay: sandbox.Layout, n2_max: int) -> str:
    try:
        return "ok: " + check_pairs(lay, n2_max).scope
    except StepFailed as exc:
        return f"not reached: {exc}"[:300]


def mesh_bash(lay: sandbox.Layout) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-bash-") as work:
        must(
            [
                str(peers.HERE / "mesh_bash.sh"),
                str(lay.ssh_config),
                work,
                *(f"{x.name}={x.address}" for x in lay.nodes),
            ],
            bound(lay.count, base=240),
        )


def mesh_ansible(lay: sandbox.Layout, opt: Options) -> None:
    bin_dir = opt.bins["ansible-core"]
    with tempfile.TemporaryDirectory(prefix="bench-ansible-") as tmp:
        work = Path(tmp)
        playbook = peers.ansible_files(work, names(lay), [x.address for x in lay.nodes])
        must(
            [str(bin_dir / "ansible-playbook"), "-i", str(work / "inventory.ini"), str(playbook)],
            bound(lay.count, base=300, per_node=10),
            env=peers.ansible_env(work, lay.ssh_config, lay.count),
        )
