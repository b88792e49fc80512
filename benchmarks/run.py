"""meshkit against the tools users would pick instead, on sandbox clusters of N nodes, in one run.

For each N and each repeat:
- mesh, each variant on a fresh cluster whose own floor (one parallel round of plain
  ``ssh node true``) is measured first: meshkit mesh with and without its NxN verify, Ansible
  (ansible-core, builtin modules), a parallel bash with ControlMaster, the seed's sequential script;
  every variant's end state is then checked with ``meshkit check`` (strict all-pairs logins; a
  sample of 4 nodes' pairs above --n2-max, recorded as such);
- on one more fresh cluster (meshed first, untimed; where meshkit's ``--no-verify`` variant was
  the last mesh, as above --peers-max and --n2-max, on that cluster): its floor,
  ``meshkit check``, one round with pdsh and clush, ``meshkit train`` of the example gloo
  all_reduce (2 processes per node) until every session runs and until every rank is done, logs,
  status and diagnose (of a running job), stop, doctor --quick and doctor; the launch peers
  pdsh+torchrun (``%n`` ranks) and torchrunx until every rank is done, each result line checked.
Every ratio is to the floor of the same cluster in the same repeat (the median of those per-sample
ratios). The nodes' ~/.bashrc costs what conda's does (``--bashrc``), and every shell a node starts
is counted per operation. Peers run only up to --peers-max nodes; N² operations only up to
--n2-max. Every step is bounded in time. Writes results/results.json (raw samples, their clusters
and floors, medians, ratios, shells per node, the commit and the machine) and the plots;
``--render-only`` redraws plots and table from an existing results.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshkit import sandbox
from meshkit.errors import SandboxError
from meshkit.sandbox.layout import default_dir, default_subnet

from . import peers, render, stats

# The benchmark's own sandbox (``--name``): several checkouts can each run one at once.
NAME = "bench"
DIR = default_dir("/var/tmp/meshkit-bench-sandbox", NAME)
SUBNET = default_subnet("10.77.0.0/24", NAME)
BASHRC = "conda"  # the nodes' ~/.bashrc (``--bashrc``)
# the nodes' sshd keeps OpenSSH's key exchanges: the peers' ssh clients pay what they would on a
# stock node (sntrup761x25519 on Debian 12), where the sandbox's default is cheaper
KEX = "openssh"
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
# meshkit as users run it: the console script of the wheel's venv (set by main; see
# peers.install_meshkit). Not `python -m meshkit`: that puts the working directory first on the
# module path, so run from this checkout it imported the checkout, not the wheel.
PYTHON = sys.executable
MESHKIT = [str(Path(sys.executable).parent / "meshkit")]
TORCHRUN = Path(sys.executable).parent / "torchrun"
PER_NODE = 2
SEED_COLLECT = (
    "test -f ~/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519; "
    "cat ~/.ssh/id_ed25519.pub"
)


class StepFailed(Exception):
    """A variant did not finish or did not reach its end state; the message says why."""


def bound(n: int, base: float = 180.0, per_node: float = 2.0, per_pair: float = 0.0) -> float:
    """Time limit of one step at N nodes: generous, but every step ends."""
    return base + per_node * n + per_pair * n * n


def run(
    argv: Sequence[str],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise StepFailed(f"{shlex.join(argv)[:200]}: no end within {timeout:.0f}s") from exc


def must(argv: Sequence[str], timeout: float, **kw: object) -> str:
    out = run(argv, timeout, **kw)  # type: ignore[arg-type]
    if out.returncode != 0:
        lines = (out.stdout + out.stderr).strip().splitlines()
        # The lines that say what failed (a doctor's failed checks come before its summary),
        # then the last three.
        bad = [x for x in lines[:-3] if re.search(r"fail|error|FAIL|✗|not ", x)][:6]
        raise StepFailed(
            f"{shlex.join(argv)[:200]} exited {out.returncode}: {' | '.join(bad + lines[-3:])}"
        )
    return out.stdout


def ssh(lay: sandbox.Layout, node: sandbox.Node, command: str) -> list[str]:
    return ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", node.name, command]


def names(lay: sandbox.Layout) -> list[str]:
    return [n.name for n in lay.nodes]


# --- the floor and the seed (the project's original baselines) ------------------------------------


def floor(lay: sandbox.Layout) -> None:
    procs = [subprocess.Popen(ssh(lay, n, "true"), stdout=subprocess.DEVNULL) for n in lay.nodes]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(bound(lay.count)))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(-1)
    if any(codes):
        raise StepFailed("floor: a plain ssh login failed")


def seed(lay: sandbox.Layout) -> None:
    """The pssh-style script: collect each key with one login per node, then one login per key per
    node, all sequential (as the seed does), appending blindly."""
    pubs = [must(ssh(lay, n, SEED_COLLECT), 180).strip() for n in lay.nodes]
    for node in lay.nodes:
        for pub in pubs:
            must(ssh(lay, node, f"echo {shlex.quote(pub)} >> ~/.ssh/authorized_keys"), 180)


def logins(lay: sandbox.Layout) -> list[int]:
    pattern = re.compile(rf"Accepted publickey for \S+ from {re.escape(lay.controller_address)} ")
    return [len(pattern.findall(lay.sshd_log(n).read_text())) for n in lay.nodes]


def reset_logs(lay: sandbox.Layout) -> None:
    for n in lay.nodes:
        lay.sshd_log(n).write_text("")


# --- end-state checkers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """What an end-state check covered: ``pairs`` ordered pairs of the cluster's ``of``."""

    scope: str
    pairs: int
    of: int


def check_pairs(lay: sandbox.Layout, n2_max: int) -> Checked:
    """Strict all-pairs logins, by meshkit check (by address and by name); above n2_max nodes only
    among 4 nodes spread over the cluster. Returns what was checked; raises if a pair fails."""
    argv = [*MESHKIT, "check", "--hostfile", str(lay.hostfile), "--json"]
    scope = f"all {lay.count}x{lay.count} pairs"
    pick = list(range(lay.count))
    if lay.count > n2_max:
        pick = sorted({0, lay.count // 3, 2 * lay.count // 3, lay.count - 1})
        argv += ["--include", ",".join(lay.nodes[i].address for i in pick)]
        scope = f"{len(pick)}x{len(pick)} pairs among nodes {pick} (sampled above --n2-max)"
    out = run(argv, bound(lay.count, per_pair=1.0))
    try:
        doc = json.loads(out.stdout)
    except json.JSONDecodeError as exc:
        raise StepFailed(
            f"check gave no JSON (exit {out.returncode}): {out.stderr[-300:]}"
        ) from exc
    failures = stats.pair_failures(doc)
    if failures or out.returncode != 0:
        raise StepFailed(f"{len(failures)} failed pairs of {scope}, e.g. {failures[:2]}")
    return Checked(scope, len(pick) * len(pick), lay.count * lay.count)


def job_dirs(lay: sandbox.Layout) -> dict[str, set[Path]]:
    """Each node's meshkit job state directories (node-private /tmp, read from the controller)."""
    found = {}
    for node in lay.nodes:
        root = lay.node_dir(node) / "tmp" / f"meshkit-{os.getuid()}" / "jobs"
        found[node.name] = set(root.iterdir()) if root.is_dir() else set()
    return found


def wait_exits(lay: sandbox.Layout, before: dict[str, set[Path]], timeout: float) -> dict[str, str]:
    """Until every node's new job wrote its exit file (no logins); node -> code.

    The harness shares this machine's two cores with the ranks it times, so its wait must cost
    next to nothing: it finds each node's new job directory once (``train`` created them all
    before it returned), then each poll stats only the first exit file still missing (every
    node must finish, so the others can wait their turn). Re-listing every node's directory at
    every poll would take noticeable CPU from meshkit's ranks, while pdsh+torchrun is timed by a
    blocking wait. Polls are 10 ms apart, so the end is seen about as soon as that blocking wait
    sees pdsh's; one stat per poll is still next to no CPU."""
    deadline = time.monotonic() + timeout
    exits: list[tuple[str, str]] = []
    for name, dirs in job_dirs(lay).items():
        exits += [(name, str(d / "exit")) for d in sorted(dirs - before[name])]
    if len({name for name, _ in exits}) < lay.count:
        raise StepFailed(f"a new job directory on only {len(exits)} of {lay.count} nodes")
    codes: dict[str, str] = {}
    for name, path in exits:
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise StepFailed(f"ranks done on {sorted(codes)} only after {timeout:.0f}s")
            time.sleep(0.01)
        with open(path) as handle:
            codes[name] = handle.read().strip()
    return codes


def check_launch(text: str, n: int) -> None:
    problems = stats.launch_problems(stats.rank_lines(text), n, PER_NODE)
    if problems:
        raise StepFailed("; ".join(problems)[:400])


# --- one measurement ------------------------------------------------------------------------------


@dataclass
class Row:
    """Everything measured at one N. Every sample is taken on a cluster (``on``): its id goes
    beside the sample (``cluster``), and the cluster's own floor is the one its ratio uses."""

    nodes: int
    raw: dict[str, list[float | None]] = field(default_factory=dict)
    cluster: dict[str, list[str]] = field(default_factory=dict)  # op/tool -> each sample's cluster
    floors: dict[str, float | None] = field(default_factory=dict)  # cluster -> its floor
    skipped: dict[str, str] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    end_state: dict[str, list[str]] = field(default_factory=dict)
    pairs_checked: dict[str, list[list[int]]] = field(default_factory=dict)  # [pairs, of]
    logins: dict[str, list[list[int]]] = field(default_factory=dict)
    shells: dict[str, list[list[int]]] = field(default_factory=dict)  # per sample, per node
    shell_commands: dict[str, list[str]] = field(default_factory=dict)  # node0's, first sample
    lay: sandbox.Layout | None = None
    current: str = ""

    def on(self, lay: sandbox.Layout, cluster: str) -> None:
        """The samples that follow are taken on ``lay``, named ``cluster`` (unique in the row)."""
        self.lay = lay
        self.current = cluster

    def sample(
        self,
        op: str,
        tool: str,
        fn: Callable[[], object],
        verify: Callable[[], str | Checked] | None = None,
        after: Callable[[], object] | None = None,
    ) -> None:
        """Time fn, counting the shells it started on every node; then (untimed) after, then
        verify: the end state. A sample whose step failed or whose end state was not reached has
        no time, only a failure line."""
        k = stats.key(op, tool)
        counting = self.lay is not None and self.lay.bashrc == "conda"
        if counting:
            assert self.lay is not None
            sandbox.reset_shells(self.lay)
        start = time.perf_counter()
        try:
            try:
                fn()
            finally:
                seconds: float | None = round(time.perf_counter() - start, 4)
                if counting:
                    self.count_shells(k)
            if after is not None:
                after()
            if verify is not None:
                checked = verify()
                if isinstance(checked, Checked):
                    self.pairs_checked.setdefault(k, []).append([checked.pairs, checked.of])
                    checked = checked.scope
                self.end_state.setdefault(k, []).append(checked)
        except StepFailed as exc:
            took = time.perf_counter() - start
            seconds = None
            self.failures.setdefault(k, []).append(f"after {took:.2f}s: {exc}")
            print(f"  N={self.nodes} {k}: FAILED {exc}", file=sys.stderr)
        self.add(k, seconds)
        if k == stats.FLOOR:
            self.floors[self.current] = seconds
        if seconds is not None:
            print(f"  N={self.nodes} {k}: {seconds:.2f}s", file=sys.stderr)

    def add(self, k: str, seconds: float | None) -> None:
        """One sample of ``k`` on the current cluster."""
        self.raw.setdefault(k, []).append(seconds)
        self.cluster.setdefault(k, []).append(self.current)

    def count_shells(self, k: str) -> None:
        assert self.lay is not None
        started = sandbox.shells(self.lay)
        self.shells.setdefault(k, []).append([len(x) for x in started])
        if k not in self.shell_commands:
            self.shell_commands[k] = [c[:160] for c in started[0][:40]]

    def skip(self, op: str, tool: str, why: str) -> None:
        self.skipped[stats.key(op, tool)] = why

    def as_json(self) -> dict[str, object]:
        medians, ratios = stats.summarize(self.raw, self.cluster, self.floors)
        return {
            "nodes": self.nodes,
            "median_s": medians,
            "ratio_to_floor": ratios,
            "shells_per_node": stats.shells_summary(self.shells),
            "raw_s": self.raw,
            "cluster": self.cluster,
            "floor_of_cluster_s": self.floors,
            "skipped": self.skipped,
            "failures": self.failures,
            "end_state": self.end_state,
            "pairs_checked": self.pairs_checked,
            "controller_logins_per_node": self.logins,
            "shells_raw": self.shells,
            "shell_commands_node0": self.shell_commands,
        }


@dataclass
class Options:
    peers_max: int
    n2_max: int
    bins: dict[str, Path]  # installed peers: name -> venv bin dir
    unavailable: dict[str, str]  # peer -> why it is not measured
    seed_max: int = 16  # the seed's N + N² sequential logins take minutes beyond this
    launch_max: int = 16  # 2 torch processes per node all share this machine's cores and memory
    launch_only: bool = False  # per repeat: one cluster, the floor and the launches only
    spawn: bool = False  # also meshkit train --spawn: no torchrun (a fourth launch)
    without: frozenset[str] = frozenset()  # op/tool keys left out (--without)


WITHOUT = ("mesh/bash_controlmaster", "mesh/seed", "round/pdsh", "round/clush", "doctor/meshkit")


def up(n: int) -> sandbox.Layout:
    return sandbox.up(DIR, SUBNET, n, NAME, bashrc=BASHRC, kex=KEX)


def count_floor_shells(row: Row, lay: sandbox.Layout) -> None:
    """The floor starts one shell per node: if the nodes' bashrc counts shells, it must have
    counted exactly that, or every shell count of the run is wrong."""
    got = row.shells.get(stats.FLOOR, [[]])[-1]
    if lay.bashrc == "conda" and got != [1] * lay.count:
        raise StepFailed(f"the floor's shells per node were {got}, want 1 on each node")


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
                [*MESHKIT, "mesh", "--hostfile", str(lay.hostfile), "--no-verify"], bound(n)
            ),
            None,
        ),
        (
            "meshkit",
            lambda lay: must(
                [*MESHKIT, "mesh", "--hostfile", str(lay.hostfile)], bound(n, per_pair=1.0)
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


def round_peer(
    row: Row, lay: sandbox.Layout, tool: str, argv: list[str], env: dict[str, str] | None
) -> None:
    checked: list[Callable[[], str | Checked]] = []
    row.sample(
        "round",
        tool,
        lambda: checked.append(one_round_peer(lay, argv, env)),
        lambda: checked[0](),
    )


def one_round_peer(
    lay: sandbox.Layout, argv: list[str], env: dict[str, str] | None = None
) -> Callable[[], str | Checked]:
    """Run the round; the checker of its end state (every node answered) comes back."""
    out = run(argv, bound(lay.count), env=env)
    answered = stats.answered(out.stdout, names(lay))
    missing = sorted(set(names(lay)) - set(answered))
    if out.returncode != 0 or missing:
        raise StepFailed(
            f"exit {out.returncode}; no answer from {missing}: {out.stderr.strip()[-200:]}"
        )
    return lambda: f"all {lay.count} nodes answered"


def meshkit_ops(row: Row, opt: Options, repeat: int, meshed: sandbox.Layout | None = None) -> None:
    """The operations on one meshed cluster: ``meshed`` (the mesh variant's, meshed by
    ``mesh --no-verify`` and checked), else a fresh one meshed here, untimed."""
    n = row.nodes
    small = n <= opt.peers_max
    lay = meshed or up(n)
    hostfile = str(lay.hostfile)
    workdir = lay.shared / "bench"
    workdir.mkdir(exist_ok=True)
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", workdir / "example_train.py")
    if meshed is None:
        try:
            must([*MESHKIT, "mesh", "--hostfile", hostfile, "--no-verify"], bound(n))
        except StepFailed as exc:
            row.failures.setdefault("setup", []).append(f"mesh for the ops cluster: {exc}")
            return
    row.on(lay, f"r{repeat + 1}/ops")
    row.sample("round", "floor", lambda: floor(lay))
    count_floor_shells(row, lay)
    if opt.launch_only:
        launches(row, lay, workdir, opt, repeat)
        return
    if n <= opt.n2_max:
        row.sample("check", "meshkit", lambda: check_pairs(lay, opt.n2_max))
    else:
        row.skip("check", "meshkit", f"N² pairs above --n2-max {opt.n2_max}")

    for tool, argv, env in (
        ("pdsh", peers.pdsh_argv(names(lay), "hostname"), peers.pdsh_env(lay.ssh_config)),
        (
            "clush",
            peers.clush_argv(
                opt.bins.get("clustershell", Path("/nonexistent")),
                lay.ssh_config,
                names(lay),
                "hostname",
            ),
            None,
        ),
    ):
        why = opt.unavailable.get("clustershell" if tool == "clush" else "pdsh")
        if f"round/{tool}" in opt.without:
            why = "left out with --without"
        if why or not small:
            row.skip("round", tool, why or f"peers only up to --peers-max {opt.peers_max}")
            continue
        round_peer(row, lay, tool, argv, env)

    job = launches(row, lay, workdir, opt, repeat)
    logs_out: list[str] = []
    row.sample(
        "round",
        "meshkit_logs",
        lambda: logs_out.append(must([*MESHKIT, "logs", *job, "--lines", "5"], bound(n))),
        lambda: logs_from_every_rank(logs_out[0], n),
    )
    long_job = ["--hostfile", hostfile, "--session", f"bsl{repeat}", "--workdir", str(workdir)]
    # A Python rank per node (--spawn, no torch): what diagnose reads a stack of.
    sleeper = [
        "--spawn",
        "--nproc-per-node",
        "1",
        "--cmd",
        "python3 -c 'import time; time.sleep(600)'",
    ]
    must([*MESHKIT, "train", *long_job, "--replace", *sleeper], bound(n, base=240))
    row.sample("round", "meshkit_status", lambda: status_running(long_job, n))
    row.sample("round", "meshkit_diagnose", lambda: diagnose_running(long_job, n))
    row.sample("round", "meshkit_stop", lambda: stop(long_job, n))

    row.sample(
        "doctor",
        "meshkit_quick",
        lambda: must([*MESHKIT, "doctor", *job, "--quick"], bound(n, base=240), cwd=workdir),
    )
    # N-1 rounds of N/2 pairs, each pair's test bounded: linear in N, so every N
    row.sample(
        "doctor",
        "meshkit_bandwidth",
        lambda: must([*MESHKIT, "doctor", *job, "--bandwidth"], bound(n, base=240), cwd=workdir),
    )
    if "doctor/meshkit" in opt.without:
        row.skip("doctor", "meshkit", "left out with --without")
    elif n <= opt.n2_max:
        row.sample(
            "doctor",
            "meshkit",
            lambda: must([*MESHKIT, "doctor", *job], bound(n, base=180, per_pair=1.0), cwd=workdir),
        )
    else:
        row.skip("doctor", "meshkit", f"its N² SSH check above --n2-max {opt.n2_max}")


def launches(row: Row, lay: sandbox.Layout, workdir: Path, opt: Options, repeat: int) -> list[str]:
    """The launches, one after another on one meshed cluster: ``meshkit train`` until every
    session runs and until every rank is done, pdsh+torchrun and torchrunx until every rank is
    done. Each starts on a settled machine (``settle``), in an order that goes through all six
    orders of the three over six repeats (``launch_order``): in a fixed order (meshkit first,
    right after the cluster came up and after check's N² logins, the peers minutes later, after
    the doctor) one sweep had meshkit 1.02-1.12x pdsh+torchrun, another on the same meshkit code
    0.90-1.02x. Returns meshkit's job flags: its logs are read next. Above --launch-max, only
    every session up, with a command that needs no torch."""
    n = row.nodes
    hostfile = str(lay.hostfile)
    if n > opt.launch_max:
        # What --launch-max bounds is 2 torch processes per node sharing this machine's cores.
        job = ["--hostfile", hostfile, "--session", f"bup{repeat}", "--workdir", str(workdir)]
        light = "echo meshkit-bench up on node $NODE_RANK; sleep 600"
        row.sample(
            "train_running",
            "meshkit",
            lambda: must([*MESHKIT, "train", *job, "--cmd", light], bound(n, base=240)),
        )
        why = f"launch until done up to --launch-max {opt.launch_max}"
        for tool in ("meshkit", "pdsh_torchrun", "torchrunx"):
            row.skip("train_done", tool, why)
        if opt.spawn:  # the light command's launch is the same with --spawn
            row.skip("train_running", "meshkit_spawn", why)
            row.skip("train_done", "meshkit_spawn", why)
        time.sleep(1.0)  # the echo is in every log
        return job
    session = f"bex{repeat}"
    job = ["--hostfile", hostfile, "--session", session, "--workdir", str(workdir)]
    order: list[Callable[[], None]] = [
        lambda: launch_meshkit(row, lay, workdir, job, session),
        lambda: launch_pdsh(row, lay, workdir, opt),
        lambda: launch_torchrunx(row, lay, workdir, opt),
    ]
    if opt.spawn:
        spawn_job = ["--hostfile", hostfile, "--session", f"bsx{repeat}", "--workdir", str(workdir)]
        order.append(
            lambda: launch_meshkit(row, lay, workdir, spawn_job, f"bsx{repeat}", spawn=True)
        )
    for index in launch_order(repeat, len(order)):
        settle()
        order[index]()
    return job


LAUNCH_ORDERS = list(itertools.permutations(range(3)))
# Four launches (with --spawn): a Williams square, each launch in each place once and right after
# each other launch once in every four repeats (all 24 orders would take 24 repeats).
LAUNCH_ORDERS_4 = [(0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1)]


def launch_order(repeat: int, count: int = 3) -> tuple[int, ...]:
    """Which launch runs first, second and third at this repeat: every one of the six orders once
    in six repeats, so each tool runs first, second and third equally often and right after
    each other tool equally often. (Rotating one order, as before, always ran meshkit right
    after torchrunx and pdsh+torchrun right after meshkit.) Four launches: LAUNCH_ORDERS_4."""
    orders = LAUNCH_ORDERS_4 if count == 4 else LAUNCH_ORDERS
    return orders[repeat % len(orders)]


def cpu_steal() -> float:
    """CPU seconds this machine's cores have had stolen by the hypervisor since boot: other
    tenants' work on the same physical cores (recorded per run, start and end)."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:9]]
    return fields[7] / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds all of this machine's cores have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def settle(limit: float = 15.0, window: float = 0.5, idle: float = 0.1) -> float:
    """Before a launch: wait until this machine is idle (under ``idle`` of one core busy over
    ``window`` seconds), at most ``limit`` seconds; the seconds waited. Back to back, whatever
    one launch left winding down (sshd sessions closing, interpreters exiting) would be taken
    from the next one's ranks."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        before = machine_busy()
        time.sleep(window)
        if machine_busy() - before < idle * window:
            break
    return time.monotonic() - start


def launch_meshkit(
    row: Row,
    lay: sandbox.Layout,
    workdir: Path,
    job: list[str],
    session: str,
    spawn: bool = False,
) -> None:
    """``meshkit train`` of the example: torchrun on every node, or (``spawn``) each node's ranks
    started by meshkit itself, the same script without torchrun."""
    n = row.nodes
    tool = "meshkit_spawn" if spawn else "meshkit"
    how = (
        ["--spawn", "--cmd", "python example_train.py"]
        if spawn
        else ["--cmd", "torchrun example_train.py"]
    )
    before = job_dirs(lay)
    start = time.perf_counter()

    def train() -> None:
        must(
            [
                *MESHKIT,
                "train",
                *job,
                "--nproc-per-node",
                str(PER_NODE),
                *how,
            ],
            bound(n, base=240),
        )

    row.sample("train_running", tool, train)
    if row.raw[f"train_running/{tool}"][-1] is None:
        return
    try:
        codes = wait_exits(lay, before, bound(n, base=300, per_node=10))
        if any(c != "0" for c in codes.values()):
            raise StepFailed(f"exit codes {codes}")
        row.add(f"train_done/{tool}", round(time.perf_counter() - start, 4))
        text = "".join(p.read_text() for p in (workdir / ".meshkit" / session).glob("node*.log"))
        check_launch(text, n)
        row.end_state.setdefault(f"train_done/{tool}", []).append(
            f"{n * PER_NODE} ranks, right sum"
        )
    except StepFailed as exc:
        row.add(f"train_done/{tool}", None)
        row.failures.setdefault(f"train_done/{tool}", []).append(str(exc))


def launch_pdsh(row: Row, lay: sandbox.Layout, workdir: Path, opt: Options) -> None:
    n = row.nodes
    if "pdsh" in opt.unavailable or n > opt.peers_max:
        row.skip(
            "train_done",
            "pdsh_torchrun",
            opt.unavailable.get("pdsh") or f"peers only up to --peers-max {opt.peers_max}",
        )
        return
    port = random.randint(20000, 40000)
    command = peers.pdsh_torchrun_command(workdir, TORCHRUN, n, PER_NODE, "node0", port)
    argv = peers.pdsh_argv(names(lay), command)
    out: list[str] = []

    def pdsh_launch() -> None:
        out.append(must(argv, bound(n, base=300, per_node=10), env=peers.pdsh_env(lay.ssh_config)))

    def pdsh_verify() -> str:
        check_launch(out[0], n)
        return f"{n * PER_NODE} ranks, right sum"

    row.sample("train_done", "pdsh_torchrun", pdsh_launch, pdsh_verify)


def launch_torchrunx(row: Row, lay: sandbox.Layout, workdir: Path, opt: Options) -> None:
    n = row.nodes
    why = opt.unavailable.get("torchrunx") or (
        None if n <= opt.peers_max else f"peers only up to --peers-max {opt.peers_max}"
    )
    if why:
        row.skip("train_done", "torchrunx", why)
        return
    trx: list[str] = []
    python = opt.bins["torchrunx"] / "python"

    def trx_launch() -> None:
        launch = [str(python), str(peers.TRX_SCRIPT), str(n), str(PER_NODE)]
        line = f"cd {shlex.quote(str(workdir))} && {shlex.join(launch)}"
        try:
            res = sandbox.node_exec(
                lay.nodes[0], ["bash", "-lc", line], timeout=bound(n, base=300, per_node=10)
            )
        except subprocess.TimeoutExpired as exc:
            raise StepFailed("torchrunx: no end in time") from exc
        if res.returncode != 0:
            raise StepFailed(f"torchrunx exited {res.returncode}: {res.stderr.strip()[-400:]}")
        trx.append(res.stdout)

    known = lay.node_dir(lay.nodes[0]) / "ssh" / "known_hosts"
    known_before = known.read_bytes() if known.exists() else b""

    def trx_verify() -> str:
        check_launch(trx[0], n)
        # fabric (under torchrunx) trusts unknown host keys (AutoAddPolicy): prove it had none
        # to trust, i.e. it only logged in to hosts meshkit mesh had made known.
        if (known.read_bytes() if known.exists() else b"") != known_before:
            raise StepFailed("torchrunx (fabric AutoAddPolicy) added a host key on node0")
        return f"{n * PER_NODE} ranks, right sum; no host key auto-added"

    row.sample("train_done", "torchrunx", trx_launch, trx_verify)


def logs_from_every_rank(text: str, n: int) -> str:
    ranks = stats.log_ranks(text)
    if ranks != list(range(n)):
        raise StepFailed(f"logs printed lines of ranks {ranks}, want 0..{n - 1}")
    return f"lines of all {n} ranks"


def status_running(job: list[str], n: int) -> None:
    rows = json.loads(must([*MESHKIT, "status", *job, "--json"], bound(n)))
    states = [r["state"] for r in rows]
    if states != ["running"] * n:
        raise StepFailed(f"status states {states}")


def diagnose_running(job: list[str], n: int) -> str:
    found = json.loads(must([*MESHKIT, "diagnose", *job, "--json"], bound(n)))
    read = {r["node"] for r in found["ranks"] if r["frames"]}
    if found["state"] != "running" or len(read) != n:
        raise StepFailed(f"diagnose: {found['state']}, stacks read on {len(read)} of {n} nodes")
    return "stacks of every node's rank"


def stop(job: list[str], n: int) -> None:
    out = must([*MESHKIT, "stop", *job], bound(n, base=240))
    if out.count("nothing left") != n:
        raise StepFailed(f"stop confirmed {out.count('nothing left')} of {n} nodes: {out[-300:]}")


def neighbours() -> dict[str, object]:
    """What else this machine is doing: its load average and the nodes of sandboxes other than
    the benchmark's (other checkouts' tests and measurements share the cores)."""
    names = run(["ip", "netns", "list"], 30).stdout.split()
    others = [
        x for x in names if x.startswith("meshkit-") and not x.startswith(f"meshkit-{NAME}-n")
    ]
    return {
        "at": time.strftime("%H:%M:%SZ", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "other_sandbox_nodes": len(others),
    }


def measure_n(n: int, repeats: int, opt: Options) -> dict[str, object]:
    row = Row(n)
    before = neighbours()
    for r in range(repeats):
        print(f"N={n} repeat {r + 1}/{repeats}", file=sys.stderr)
        meshed = None
        for part in ("ops",) if opt.launch_only else ("mesh", "ops"):
            try:
                if part == "mesh":
                    meshed = mesh_variants(row, opt, r)
                else:
                    meshkit_ops(row, opt, r, meshed)
            except (StepFailed, SandboxError) as exc:
                # A broken setup step loses this repeat's remaining samples, not the sweep.
                row.failures.setdefault("setup", []).append(f"repeat {r + 1}: {exc}"[:400])
                print(f"  N={n} setup FAILED: {exc}", file=sys.stderr)
    sandbox.down(DIR, NAME)
    return {**row.as_json(), "machine_load": [before, neighbours()]}


# Timed inside a node: ``meshkit env`` as every node runs it at every launch (the hostfile matched
# against the node's own addresses), beside a bare interpreter that imports netifaces, interleaved.
ENV_TIMER = r"""
import json, subprocess, sys, time
python, meshkit, hostfile, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cases = {
    "bare": [python, "-c", "import netifaces"],
    "hostfile": [meshkit, "env", "--hostfile", hostfile],
    "node_rank": [meshkit, "env", "--hostfile", hostfile, "--node-rank", "1"],
}
took = {k: [] for k in cases}
for _ in range(repeats):
    for k, argv in cases.items():
        start = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        took[k].append(round(time.perf_counter() - start, 4))
        if out.returncode != 0:
            sys.exit(f"{argv}: exit {out.returncode}: {out.stderr[-300:]}")
        if k == "hostfile" and "NODE_RANK=1" not in out.stdout:
            sys.exit(f"env on node1 did not say NODE_RANK=1: {out.stdout[-300:]}")
print(json.dumps(took))
"""


def measure_env(repeats: int) -> dict[str, object]:
    """``meshkit env`` inside node1 of a 2-node sandbox: on the hostfile-matching path users run
    (the hostfile's addresses against the node's interfaces), and with ``--node-rank``, each
    against a bare ``python -c "import netifaces"`` timed the same way."""
    lay = up(2)
    try:
        res = sandbox.node_exec(
            lay.nodes[1],
            [PYTHON, "-c", ENV_TIMER, PYTHON, MESHKIT[0], str(lay.hostfile), str(repeats)],
            timeout=300,
        )
    finally:
        sandbox.down(DIR, NAME)
    if res.returncode != 0:
        raise StepFailed(f"env timing in node1: {res.stderr.strip()[-400:]}")
    took = json.loads(res.stdout)
    b, e, r = (stats.median(took[k]) for k in ("bare", "hostfile", "node_rank"))
    assert b is not None and e is not None and r is not None
    return {
        "where": "inside node1 of a 2-node sandbox, interleaved, each a fresh process",
        "bare_import_netifaces_s": round(b, 4),
        "meshkit_env_s": round(e, 4),
        "env/bare": round(e / b, 2),
        "meshkit_env_node_rank_s": round(r, 4),
        "env_node_rank/bare": round(r / b, 2),
        "raw_s": took,
    }


TRX_VERSION = (
    "import importlib.metadata as m, torch; "
    "print('torchrunx', m.version('torchrunx'), 'torch', torch.__version__)"
)


def install_peers() -> tuple[dict[str, Path], dict[str, str], dict[str, str]]:
    """Install (or reuse) every peer; what works, why the rest does not, and versions."""
    bins: dict[str, Path] = {}
    unavailable: dict[str, str] = {}
    versions: dict[str, str] = {}
    for peer, probe in (
        ("ansible-core", ["ansible-playbook", "--version"]),
        ("clustershell", ["clush", "--version"]),
        (
            "torchrunx",
            [
                "python",
                "-c",
                TRX_VERSION,
            ],
        ),
    ):
        try:
            bins[peer] = peers.install(peer)
            versions[peer] = peers.version([str(bins[peer] / probe[0]), *probe[1:]])
        except peers.PeerUnavailable as exc:
            unavailable[peer] = str(exc)
            bins.pop(peer, None)
    try:
        versions["pdsh"] = peers.version(["pdsh", "-V"])
    except peers.PeerUnavailable as exc:
        unavailable["pdsh"] = f"Debian pdsh not installed (apt-get install pdsh): {exc}"
    return bins, unavailable, versions


def node_shell() -> dict[str, object]:
    """Every remote command runs the user's bash, which reads ~/.bashrc: what it costs is part of
    every login of every tool here, so the results name it and carry its text."""
    return {
        "bashrc": BASHRC,
        "about": sandbox.BASHRCS[BASHRC],
        "text": sandbox.CONDA_BASHRC if BASHRC == "conda" else sandbox.NODE_BASHRC,
    }


def commit() -> dict[str, object]:
    """The commit measured (this checkout's HEAD) and whether the tree differed from it."""

    def git(*args: str) -> str:
        out = run(["git", "-C", str(REPO), *args], 30)
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "subject": git("log", "-1", "--format=%s")[:200],
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def sizes_arg(text: str, repeats: int) -> list[tuple[int, int]]:
    """``--nodes``: a comma list of N, each optionally ``NxR`` (R repeats at that N instead of
    --repeats), e.g. ``2,4,8,16,64x2,244x1``."""
    out = []
    for word in text.split(","):
        n, sep, r = word.strip().partition("x")
        if not (n.isascii() and n.isdigit()) or (sep and not (r.isascii() and r.isdigit())):
            raise SystemExit(f"--nodes {text!r}: {word!r} is not N or NxR")
        size = int(n)
        reps = repeats
        if r:
            reps = int(r)
        if not 1 <= size <= sandbox.MAX_NODES or reps < 1:
            raise SystemExit(f"--nodes {word!r}: N is 1..{sandbox.MAX_NODES}, R at least 1")
        out.append((size, reps))
    return out


def machine() -> dict[str, object]:
    mem = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        "0",
    )
    ssh_v = subprocess.run(
        ["ssh", "-V"], capture_output=True, text=True, check=False
    ).stderr.strip()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(int(mem) / 1024 / 1024, 1),
        "python": platform.python_version(),
        "openssh": ssh_v,
        "kernel": platform.release(),
        "machine": platform.machine(),
        "quiet_machine": "UNSET: the person running the sweep states here whether nothing else ran",
    }


def main(argv: Sequence[str] | None = None) -> None:
    global TORCHRUN, PYTHON, NAME, DIR, SUBNET, BASHRC
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nodes",
        default="2,4,8,16",
        help=f"comma list of cluster sizes (at most {sandbox.MAX_NODES}), each N or NxR (R repeats "
        "at that N)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    for flag, text in (
        ("--peers-max", "largest N the peers run at"),
        ("--n2-max", "largest N for N² operations (mesh verify, check, doctor)"),
        ("--seed-max", "largest N the seed's sequential script runs at"),
        (
            "--launch-max",
            "largest N for launch until every rank is done (2 torch processes per node share "
            "this machine); above it, train is timed until every session runs, with a light "
            "command",
        ),
    ):
        parser.add_argument(flag, type=int, default=16, help=text)
    parser.add_argument(
        "--launch-only",
        action="store_true",
        help="per N and repeat: one meshed cluster, the floor and the launches only (all six "
        "orders of the three over six repeats); use with --results elsewhere, beside a full sweep",
    )
    parser.add_argument(
        "--spawn",
        action="store_true",
        help="with --launch-only: a fourth launch, meshkit train --spawn (each node's ranks "
        "started by meshkit, no torchrun)",
    )
    parser.add_argument(
        "--without",
        default="",
        help="comma list of measurements to leave out, to fit a sweep in its time: any of "
        + ", ".join(WITHOUT),
    )
    parser.add_argument(
        "--bashrc",
        default="conda",
        choices=sorted(sandbox.BASHRCS),
        help="the nodes' ~/.bashrc: conda (default: about 0.1 s of CPU per shell, as conda init "
        "leaves it, and every shell counted) or minimal (one line, no shells counted)",
    )
    parser.add_argument(
        "--name",
        default=NAME,
        help="the benchmark sandbox's name (1-8 lowercase letters or digits): two checkouts "
        "benchmarking on one machine use different ones",
    )
    parser.add_argument(
        "--quiet-machine", default=None, help="note stored in results.json: was the machine quiet?"
    )
    parser.add_argument(
        "--results", default=str(RESULTS), help="directory for results.json and the plots"
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="redraw plots and table from an existing results.json",
    )
    args = parser.parse_args(argv)
    out_dir = Path(args.results)
    if args.render_only:
        path = out_dir / "results.json"
        try:
            stored = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--render-only: cannot read {path}: {exc}") from exc
        if not isinstance(stored, dict) or not isinstance(stored.get("sizes"), list):
            raise SystemExit(f"--render-only: {path} is not this benchmark's results (no 'sizes')")
        print(render.render(stored, out_dir))
        return
    if os.geteuid() != 0:
        raise SystemExit("benchmarks build sandbox clusters: run as root")
    sizes = sizes_arg(args.nodes, args.repeats)
    unknown = set(args.without.split(",")) - {""} - set(WITHOUT)
    if unknown:
        raise SystemExit(f"--without: unknown {', '.join(sorted(unknown))}; expected {WITHOUT}")
    try:
        NAME = sandbox.check_name(args.name)
    except SandboxError as exc:
        raise SystemExit(str(exc)) from None
    DIR = default_dir("/var/tmp/meshkit-bench-sandbox", NAME)
    SUBNET = default_subnet("10.77.0.0/24", NAME)
    BASHRC = args.bashrc
    product = peers.install_meshkit(REPO)
    PYTHON = str(product / "python")
    MESHKIT[:] = [str(product / "meshkit")]
    TORCHRUN = product / "torchrun"
    bins, unavailable, versions = install_peers()
    opt = Options(
        args.peers_max,
        args.n2_max,
        bins,
        unavailable,
        args.seed_max,
        args.launch_max,
        args.launch_only,
        args.spawn,
        frozenset(args.without.split(",")) - {""},
    )
    for peer, why in unavailable.items():
        print(f"peer {peer} not measured: {why}", file=sys.stderr)
    doc: dict[str, object] = {
        "measured": {
            **commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "machine": machine(),
        "node_shell": node_shell(),
        "settings": {
            "nodes": [n for n, _ in sizes],
            "repeats": {str(n): r for n, r in sizes},
            "peers_max": args.peers_max,
            "n2_max": args.n2_max,
            "seed_max": args.seed_max,
            "launch_max": args.launch_max,
            "launch_only": args.launch_only,
            "spawn": args.spawn,
            "without": args.without,
            "sandbox": NAME,
            "meshkit": f"this checkout's wheel, installed (not editable) into {product.parent}",
            "processes_per_node": PER_NODE,
            "ratios": "each sample over the floor of its own cluster, then the median of those",
        },
        "peers": {"versions": versions, "unavailable": unavailable},
    }
    if args.quiet_machine is not None:
        doc["machine"] = {**machine(), "quiet_machine": args.quiet_machine}
    out_dir.mkdir(parents=True, exist_ok=True)
    steal_before = cpu_steal()
    if not args.launch_only:  # first: it takes seconds, and a sweep cut short keeps it
        try:
            doc["env"] = measure_env(max(5, args.repeats * 3))
        except (StepFailed, SandboxError) as exc:
            doc["env"] = {"failed": str(exc)[:400]}
    rows: list[dict[str, object]] = []
    for n, r in sizes:
        rows.append(measure_n(n, r, opt))
        # Written after every N, in order of N whatever order they ran in: a sweep cut short
        # still leaves every N it finished.
        doc["sizes"] = sorted(rows, key=lambda row: int(str(row["nodes"])))
        (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc["measured"]["finished"] = finished  # type: ignore[index]
    doc["measured"]["cpu_steal_s"] = round(cpu_steal() - steal_before, 1)  # type: ignore[index]
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(render.render(doc, out_dir))


if __name__ == "__main__":
    main()
