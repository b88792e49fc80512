"""``meshkit exec`` against the tools users run one command everywhere with: pdsh, clush, pssh.

``python -m benchmarks.exec_peers [--nodes 8,64] [--repeats 5] [--out DIR] [--baseline REF]``
(root; ``--baseline``: also that commit's meshkit, in the same rounds) builds one
sandbox per N (the conda-like bashrc, as the main benchmark's) and, in each repeat, in a rotating
order: the floor (N parallel ``ssh node true``), then one round of ``hostname`` on every node with
each tool at full fan-out:
- ``meshkit exec --cmd hostname`` (this checkout's wheel, as the main benchmark installs it;
  ``MESHKIT_PARALLEL=N``);
- ``pdsh -R ssh -f N -w NODES hostname`` (Debian pdsh);
- ``clush -b -f N -w NODES hostname`` (clustershell in the benchmark's peer venv);
- ``parallel-ssh -i -p N -h HOSTS hostname`` (Debian pssh: ``apt-get install pssh``).
Every round is checked: each node's name must be in the tool's output. Each tool's median is
compared with the fastest tool's (the target: ``meshkit exec`` within 1.1x of it) and with the
floor. Where the CLI's own start goes is measured too (``startup``): up to the first connection,
the SSH side's imports, against a bare interpreter, and ``-X importtime``'s self times summed
per top-level package. Writes
``OUT/results.json`` (default ``benchmarks/results/exec-peers``) and prints a table.

Run it on a quiet machine: every tool here is bound by this machine's CPU, which the nodes share.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from meshkit import sandbox
from meshkit.sandbox.layout import default_subnet

from . import peers
from .harness import RESULTS, commit, machine, machine_busy
from .stats import answered

NAME = "bexec"
ROOT = "/var/tmp/meshkit-bench-sandbox-bexec"
BASHRC = "conda"
KEX = "openssh"  # the peers' ssh clients negotiate what they would with a stock node's sshd
COMMAND = "hostname"
TOOLS = ("meshkit", "pdsh", "clush", "pssh")
BASELINE = "meshkit-base"  # --baseline REF: that commit's meshkit, measured beside this one
IMPORT_SAMPLES = 5
SSH_IMPORTS = (  # what connecting adds to exec's imports, in seconds
    "import time, meshkit.ops.execute\n"
    "start = time.perf_counter()\n"
    "import meshkit.remote\n"
    "print(time.perf_counter() - start)"
)


class Unavailable(Exception):
    """A tool is not installed here; the message says how to install it."""


def tool_argv(tool: str, lay: sandbox.Layout, bins: dict[str, Path]) -> list[str]:
    """One round of ``COMMAND`` on every node with ``tool``, at full fan-out."""
    names = [node.name for node in lay.nodes]
    fan_out = str(lay.count)
    if tool in ("meshkit", BASELINE):
        return [
            str(bins[tool] / "meshkit"),
            "exec",
            "--hostfile",
            str(lay.hostfile),
            "--cmd",
            COMMAND,
        ]
    if tool == "pdsh":
        return peers.pdsh_argv(names, COMMAND)
    if tool == "clush":
        return peers.clush_argv(bins["clustershell"], lay.ssh_config, names, COMMAND)
    if tool == "pssh":
        hosts = Path(lay.root) / "pssh-hosts"
        hosts.write_text("".join(f"{name}\n" for name in names))
        options = f"-F {lay.ssh_config} -oBatchMode=yes -oStrictHostKeyChecking=yes"
        return ["parallel-ssh", "-i", "-p", fan_out, "-h", str(hosts), "-x", options, COMMAND]
    raise ValueError(tool)


def tool_env(tool: str, lay: sandbox.Layout) -> dict[str, str] | None:
    if tool == "pdsh":
        return peers.pdsh_env(lay.ssh_config)
    if tool in ("meshkit", BASELINE):  # full fan-out, as the others are given (-f N, -p N)
        return {**os.environ, "MESHKIT_PARALLEL": str(lay.count)}
    return None


def floor_argvs(lay: sandbox.Layout) -> list[list[str]]:
    ssh = ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes"]
    return [[*ssh, node.name, "true"] for node in lay.nodes]


def timed(
    argvs: Sequence[Sequence[str]], env: dict[str, str] | None, limit: float
) -> tuple[float, str, float]:
    """Run the commands at once; the wall time, their output together, and the CPU seconds they
    and their children took here (the controller's side: one meshkit process, or pdsh and its
    N ssh clients). A failure raises."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for argv in argvs
    ]
    outputs = []
    for process in procs:
        out, _ = process.communicate(timeout=limit)
        if process.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(process.args)} exited {process.returncode}: {out[-300:]}"
            )
        outputs.append(out)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, "".join(outputs), cpu


def settle(seconds: float = 15.0) -> None:
    """Wait (bounded) until the machine is nearly idle: the last round's sshd sessions close."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = machine_busy()
        time.sleep(0.5)
        if machine_busy() - before < 0.05:
            return


def install(
    tools: Sequence[str], baseline: str | None = None
) -> tuple[dict[str, Path], dict[str, str], dict[str, str]]:
    """What each tool runs from, its version, and why any is missing. ``baseline``: a commit of
    this repository whose meshkit is installed beside this checkout's (``BASELINE``)."""
    bins: dict[str, Path] = {}
    versions: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    repo = Path(__file__).resolve().parent.parent
    if baseline is not None:
        source = peers.CACHE / "meshkit-base-source"
        subprocess.run(["rm", "-rf", str(source)], check=True, timeout=60)
        source.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", baseline], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
        bins[BASELINE] = peers.install_meshkit(source, BASELINE)
        versions[BASELINE] = f"meshkit at {baseline}"
    probes = {
        "meshkit": lambda: [str(bins["meshkit"] / "meshkit"), "--version"],
        "pdsh": lambda: ["pdsh", "-V"],
        "clush": lambda: [str(bins["clustershell"] / "clush"), "--version"],
        "pssh": lambda: ["parallel-ssh", "--version"],
    }
    for tool in tools:
        try:
            if tool == "meshkit":
                bins["meshkit"] = peers.install_meshkit(repo)
            if tool == "clush":
                bins["clustershell"] = peers.install("clustershell")
            versions[tool] = peers.version(probes[tool]())
        except peers.PeerUnavailable as exc:
            hint = {"pdsh": " (apt-get install pdsh)", "pssh": " (apt-get install pssh)"}
            unavailable[tool] = f"{exc}{hint.get(tool, '')}"
    return bins, versions, unavailable


def startup(installs: dict[str, Path]) -> dict[str, dict[str, object]]:
    """Where ``meshkit exec``'s own start goes, per install (this checkout's, the baseline's),
    sampled in turn so that both see the same machine: median wall seconds of
    ``IMPORT_SAMPLES`` of a bare interpreter; ``meshkit exec`` until just before the first node
    is contacted (flags, the configuration and every import but SSH's: a ``--timeout 0`` it
    refuses, exit 2), also as CPU seconds; the SSH side's imports on top of that
    (``meshkit.remote``: paramiko, fabric; timed in the process that imported the rest first);
    ``meshkit exec -h`` (invoke's path). With ``-X importtime``'s self times of the command's
    path summed per top-level package (the median sample's, milliseconds)."""
    refused = ["exec", "--cmd", "true", "--timeout", "0"]
    walls: dict[str, dict[str, list[float]]] = {}
    packages: dict[str, list[dict[str, float]]] = {name: [] for name in installs}
    for _ in range(IMPORT_SAMPLES):
        for install, bin_dir in installs.items():
            python = str(bin_dir / "python")
            argvs = {
                "bare_interpreter_s": [python, "-c", "pass"],
                "meshkit_exec_until_connect_s": [str(bin_dir / "meshkit"), *refused],
                "meshkit_exec_help_s": [str(bin_dir / "meshkit"), "exec", "-h"],
            }
            own = walls.setdefault(install, {})
            for name, argv in argvs.items():
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                subprocess.run(argv, capture_output=True, timeout=60, check=False)
                own.setdefault(name, []).append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                own.setdefault(name.replace("_s", "_cpu_s"), []).append(used)
            printed = subprocess.run(
                [python, "-c", SSH_IMPORTS], capture_output=True, text=True, timeout=60
            )
            own.setdefault("ssh_imports_s", []).append(float(printed.stdout))
            traced = subprocess.run(
                [python, "-X", "importtime", "-m", "meshkit", *refused],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            packages[install].append(import_self_times(traced.stderr))
    found: dict[str, dict[str, object]] = {}
    for install, own in walls.items():
        totals = [sum(sample.values()) for sample in packages[install]]
        middle = packages[install][totals.index(sorted(totals)[len(totals) // 2])]
        top = dict(sorted(middle.items(), key=lambda item: -item[1])[:15])
        figures: dict[str, object] = {
            name: round(statistics.median(values), 4) for name, values in own.items()
        }
        figures["import_ms_by_package"] = {name: round(ms, 1) for name, ms in top.items()}
        figures["import_ms_total"] = round(sum(middle.values()), 1)
        found[install] = figures
    return found


def import_self_times(trace: str) -> dict[str, float]:
    """``-X importtime``'s self times in ms, summed per top-level package (meshkit per
    subpackage: ``meshkit.ops``, ``meshkit.cli``, ...)."""
    sums: dict[str, float] = {}
    for line in trace.splitlines():
        found = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if found is None:
            continue
        parts = found.group(2).split(".")
        name = ".".join(parts[:2]) if parts[0] == "meshkit" else parts[0]
        sums[name] = sums.get(name, 0.0) + int(found.group(1)) / 1000
    return sums


def measure(
    count: int, repeats: int, tools: Sequence[str], bins: dict[str, Path]
) -> dict[str, object]:
    """One sandbox of ``count`` nodes: each repeat, the floor and each tool once, in turn."""
    lay = sandbox.up(ROOT, default_subnet("", NAME), count, NAME, bashrc=BASHRC, kex=KEX)
    samples: dict[str, list[float]] = {"floor": []}
    cpu: dict[str, list[float]] = {"floor": []}
    failures: dict[str, list[str]] = {}
    limit = 120.0 + 2.0 * count
    try:
        for repeat in range(repeats):
            order = list(tools[repeat % len(tools) :]) + list(tools[: repeat % len(tools)])
            settle()
            floor_wall, _, floor_cpu = timed(floor_argvs(lay), None, limit)
            samples["floor"].append(floor_wall)
            cpu["floor"].append(floor_cpu)
            for tool in order:
                settle()
                try:
                    argv = tool_argv(tool, lay, bins)
                    seconds, out, used = timed([argv], tool_env(tool, lay), limit)
                    names = [node.name for node in lay.nodes]
                    missing = sorted(set(names) - set(answered(out, names)))
                    if missing:
                        raise RuntimeError(f"no answer from {missing[:5]}: {out[-300:]}")
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                    failures.setdefault(tool, []).append(str(exc)[:500])
                    continue
                samples.setdefault(tool, []).append(seconds)
                cpu.setdefault(tool, []).append(used)
                sample = f"N={count} r{repeat + 1} {tool}: {seconds:.3f}s"
                print(sample, file=sys.stderr, flush=True)
    finally:
        sandbox.down(ROOT, NAME)
    medians = {
        tool: round(statistics.median(values), 4) for tool, values in samples.items() if values
    }
    peers_only = [medians[tool] for tool in tools if tool in medians]
    fastest = min(peers_only) if peers_only else None
    ratios = {}
    for tool in tools:
        if tool in medians and fastest:
            ratios[tool] = round(medians[tool] / fastest, 3)
    paired = {}
    for tool in tools:
        mine = samples.get("meshkit", [])
        theirs = samples.get(tool, [])
        if tool != "meshkit" and mine and len(mine) == len(theirs):
            each = [ours / other for ours, other in zip(mine, theirs)]
            paired[tool] = round(statistics.median(each), 3)
    return {
        "nodes": count,
        "samples": samples,
        "medians_s": medians,
        # meshkit's time over each tool's in the same repeat, the median of those: the rounds
        # of one repeat share the machine's state, which moves between repeats here
        "meshkit_paired_ratio": paired,
        "controller_cpu_s": {
            tool: round(statistics.median(values), 4) for tool, values in cpu.items() if values
        },
        "controller_cpu_samples": cpu,
        "ratio_to_fastest": ratios,
        "ratio_to_floor": {
            tool: round(value / medians["floor"], 3)
            for tool, value in medians.items()
            if "floor" in medians
        },
        "failures": failures,
    }


def table(rows: Sequence[dict[str, object]], tools: Sequence[str]) -> str:
    lines = [
        "| N | floor, s | " + " | ".join(tools) + " |",
        "|---|---|" + "---|" * len(tools),
    ]
    for row in rows:
        medians = row["medians_s"]
        ratios = row["ratio_to_fastest"]
        assert isinstance(medians, dict) and isinstance(ratios, dict)
        cells = []
        for tool in tools:
            if tool in medians:
                cells.append(f"{medians[tool]:.2f} ({ratios[tool]:.2f}×)")
            else:
                cells.append("–")
        lines.append(
            f"| {row['nodes']} | {medians.get('floor', 0):.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.exec_peers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nodes", default="8,64", help="comma list of N (default 8,64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma list of " + ",".join(TOOLS))
    parser.add_argument("--out", default=str(RESULTS / "exec-peers"))
    parser.add_argument("--no-startup", action="store_true", help="leave out the start-up measure")
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help=f"also time that commit's meshkit ({BASELINE}), beside this checkout's",
    )
    args = parser.parse_args(argv)
    sizes = [int(word) for word in args.nodes.split(",")]
    chosen = [tool for tool in args.tools.split(",") if tool]
    unknown = sorted(set(chosen) - set(TOOLS))
    if unknown or args.repeats < 1:
        raise SystemExit(f"--tools: unknown {unknown}; --repeats: at least 1")
    bins, versions, unavailable = install(chosen, args.baseline)
    tools = [tool for tool in chosen if tool not in unavailable]
    if args.baseline is not None:
        tools.append(BASELINE)
    for tool, why in unavailable.items():
        print(f"left out {tool}: {why}", file=sys.stderr)
    rows = [measure(count, args.repeats, tools, bins) for count in sizes]
    results: dict[str, object] = {
        "command": COMMAND,
        "bashrc": BASHRC,
        "repeats": args.repeats,
        "tools": tools,
        "versions": versions,
        "unavailable": unavailable,
        "rows": rows,
        "commit": commit(),
        "machine": machine(),
    }
    if args.baseline is not None:
        results["baseline"] = args.baseline
    installs = {name: bins[name] for name in ("meshkit", BASELINE) if name in bins}
    if installs and not args.no_startup:
        measured = startup(installs)
        results["startup"] = measured.get("meshkit")
        results["startup_baseline"] = measured.get(BASELINE)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(rows, tools))
    if "startup" in results:
        print(json.dumps(results["startup"], indent=2))
    print(f"written: {out / 'results.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
