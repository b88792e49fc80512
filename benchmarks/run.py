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
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meshkit import sandbox
from meshkit.errors import SandboxError

from . import cluster, peers, render, stats
from .cluster import PER_NODE, Checked, check_pairs, floor, names, up
from .harness import REPO, RESULTS, StepFailed, bound, commit, cpu_steal, machine, must, run
from .launches import launches
from .measurement import WITHOUT, Options, Row, count_floor_shells
from .mesh_variants import mesh_variants


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
            must([*cluster.MESHKIT, "mesh", "--hostfile", hostfile, "--no-verify"], bound(n))
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
        lambda: logs_out.append(must([*cluster.MESHKIT, "logs", *job, "--lines", "5"], bound(n))),
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
    must([*cluster.MESHKIT, "train", *long_job, "--replace", *sleeper], bound(n, base=240))
    row.sample("round", "meshkit_status", lambda: status_running(long_job, n))
    row.sample("round", "meshkit_diagnose", lambda: diagnose_running(long_job, n))
    row.sample("round", "meshkit_stop", lambda: stop(long_job, n))

    row.sample(
        "doctor",
        "meshkit_quick",
        lambda: must(
            [*cluster.MESHKIT, "doctor", *job, "--quick"], bound(n, base=240), cwd=workdir
        ),
    )
    # N-1 rounds of N/2 pairs, each pair's test bounded: linear in N, so every N
    row.sample(
        "doctor",
        "meshkit_bandwidth",
        lambda: must(
            [*cluster.MESHKIT, "doctor", *job, "--bandwidth"], bound(n, base=240), cwd=workdir
        ),
    )
    if "doctor/meshkit" in opt.without:
        row.skip("doctor", "meshkit", "left out with --without")
    elif n <= opt.n2_max:
        row.sample(
            "doctor",
            "meshkit",
            lambda: must(
                [*cluster.MESHKIT, "doctor", *job], bound(n, base=180, per_pair=1.0), cwd=workdir
            ),
        )
    else:
        row.skip("doctor", "meshkit", f"its N² SSH check above --n2-max {opt.n2_max}")


def logs_from_every_rank(text: str, n: int) -> str:
    ranks = stats.log_ranks(text)
    if ranks != list(range(n)):
        raise StepFailed(f"logs printed lines of ranks {ranks}, want 0..{n - 1}")
    return f"lines of all {n} ranks"


def status_running(job: list[str], n: int) -> None:
    rows = json.loads(must([*cluster.MESHKIT, "status", *job, "--json"], bound(n)))
    states = [r["state"] for r in rows]
    if states != ["running"] * n:
        raise StepFailed(f"status states {states}")


def diagnose_running(job: list[str], n: int) -> str:
    found = json.loads(must([*cluster.MESHKIT, "diagnose", *job, "--json"], bound(n)))
    read = {r["node"] for r in found["ranks"] if r["frames"]}
    if found["state"] != "running" or len(read) != n:
        raise StepFailed(f"diagnose: {found['state']}, stacks read on {len(read)} of {n} nodes")
    return "stacks of every node's rank"


def stop(job: list[str], n: int) -> None:
    out = must([*cluster.MESHKIT, "stop", *job], bound(n, base=240))
    if out.count("nothing left") != n:
        raise StepFailed(f"stop confirmed {out.count('nothing left')} of {n} nodes: {out[-300:]}")


def measure_n(n: int, repeats: int, opt: Options) -> dict[str, object]:
    row = Row(n)
    before = cluster.neighbours()
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
    sandbox.down(cluster.DIR, cluster.NAME)
    return {**row.as_json(), "machine_load": [before, cluster.neighbours()]}


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
            [
                cluster.PYTHON,
                "-c",
                ENV_TIMER,
                cluster.PYTHON,
                cluster.MESHKIT[0],
                str(lay.hostfile),
                str(repeats),
            ],
            timeout=300,
        )
    finally:
        sandbox.down(cluster.DIR, cluster.NAME)
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


def main(argv: Sequence[str] | None = None) -> None:
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
        default=cluster.NAME,
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
        name = sandbox.check_name(args.name)
    except SandboxError as exc:
        raise SystemExit(str(exc)) from None
    cluster.name_sandbox(name, args.bashrc)
    product = peers.install_meshkit(REPO)
    cluster.use_meshkit(product)
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
        "node_shell": cluster.node_shell(),
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
            "sandbox": cluster.NAME,
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
