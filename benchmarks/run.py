"""Side-by-side timings on sandbox clusters of N nodes, in one run (ratios, not absolute claims).

For each N: the floor (one parallel round of plain OpenSSH logins), meshkit mesh with and without
verify, the seed's sequential N + N^2 logins, meshkit train against a sequential ssh-per-node tmux
launch, and (once) meshkit env against a bare interpreter importing netifaces. Controller logins per
node are counted from each node's sshd log. Writes results/results.json and results/mesh_scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from meshkit import sandbox

DIR = "/var/tmp/meshkit-bench-sandbox"
SUBNET = "10.77.0.0/24"
RESULTS = Path(__file__).resolve().parent / "results"
MESHKIT = [sys.executable, "-m", "meshkit"]
SEED_COLLECT = (
    "test -f ~/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519; "
    "cat ~/.ssh/id_ed25519.pub"
)


def ssh(lay: sandbox.Layout, node: sandbox.Node, command: str) -> list[str]:
    return ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", node.address, command]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check(argv: list[str], **kw: object) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, **kw)  # type: ignore[call-overload]
    if out.returncode != 0:
        raise SystemExit(f"benchmark step failed: {shlex.join(argv)}\n{out.stdout}\n{out.stderr}")
    return str(out.stdout)


def floor(lay: sandbox.Layout) -> None:
    procs = [subprocess.Popen(ssh(lay, n, "true"), stdout=subprocess.DEVNULL) for n in lay.nodes]
    if any(p.wait(60) != 0 for p in procs):
        raise SystemExit("floor: a plain ssh login failed")


def seed(lay: sandbox.Layout) -> None:
    """The pssh-style script: collect each key with one login per node, then one login per key per
    node, all sequential (as the seed does), appending blindly."""
    pubs = [check(ssh(lay, n, SEED_COLLECT)).strip() for n in lay.nodes]
    for node in lay.nodes:
        for pub in pubs:
            check(ssh(lay, node, f"echo {shlex.quote(pub)} >> ~/.ssh/authorized_keys"))


def logins(lay: sandbox.Layout) -> list[int]:
    pattern = re.compile(rf"Accepted publickey for \S+ from {re.escape(lay.controller_address)} ")
    return [len(pattern.findall(lay.sshd_log(n).read_text())) for n in lay.nodes]


def reset_logs(lay: sandbox.Layout) -> None:
    for n in lay.nodes:
        lay.sshd_log(n).write_text("")


def launch_meshkit(lay: sandbox.Layout, workdir: Path) -> None:
    check(
        [
            *MESHKIT,
            "train",
            "--hostfile",
            str(lay.hostfile),
            "--session",
            "bench",
            "--workdir",
            str(workdir),
            "--cmd",
            "sleep 60",
        ]
    )


def launch_sequential(lay: sandbox.Layout, workdir: Path) -> None:
    for rank, node in enumerate(lay.nodes):
        command = shlex.join(
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                "seq",
                "-c",
                str(workdir),
                f"NODE_RANK={rank} sleep 60",
            ]
        )
        check(ssh(lay, node, command))


def stop_all(lay: sandbox.Layout, workdir: Path) -> None:
    subprocess.run(
        [*MESHKIT, "stop", "--session", "bench", "--workdir", str(workdir)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    for node in lay.nodes:
        subprocess.run(
            ssh(lay, node, "tmux kill-server"), capture_output=True, timeout=30, check=False
        )


def one_round(n: int) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Every variant once, each on a fresh sandbox state (unmesh between meshes is not timed)."""
    lay = sandbox.up(DIR, SUBNET, n)
    hostfile = str(lay.hostfile)
    workdir = lay.shared / "bench"
    workdir.mkdir(exist_ok=True)
    times: dict[str, float] = {"floor": timed(lambda: floor(lay))}
    reset_logs(lay)
    times["mesh_no_verify"] = timed(
        lambda: check([*MESHKIT, "mesh", "--hostfile", hostfile, "--no-verify"])
    )
    counted = {"mesh": logins(lay)}
    check([*MESHKIT, "unmesh", "--hostfile", hostfile])
    times["mesh"] = timed(lambda: check([*MESHKIT, "mesh", "--hostfile", hostfile]))
    check([*MESHKIT, "unmesh", "--hostfile", hostfile])
    reset_logs(lay)
    times["seed"] = timed(lambda: seed(lay))
    counted["seed"] = logins(lay)
    times["launch"] = timed(lambda: launch_meshkit(lay, workdir))
    times["launch_sequential"] = timed(lambda: launch_sequential(lay, workdir))
    stop_all(lay, workdir)
    return times, counted


def measure_n(n: int, repeats: int) -> dict[str, object]:
    rounds = [one_round(n) for _ in range(repeats)]
    sandbox.down(DIR)
    med = {k: statistics.median(r[0][k] for r in rounds) for k in rounds[0][0]}
    counted = {k: sorted({c for r in rounds for c in r[1][k]}) for k in rounds[0][1]}
    print(f"N={n}: " + ", ".join(f"{k} {v:.2f}s" for k, v in med.items()), file=sys.stderr)
    return {
        "nodes": n,
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "ratios": {
            "mesh/floor": round(med["mesh"] / med["floor"], 2),
            "mesh_no_verify/floor": round(med["mesh_no_verify"] / med["floor"], 2),
            "seed/mesh": round(med["seed"] / med["mesh"], 2),
            "seed/mesh_no_verify": round(med["seed"] / med["mesh_no_verify"], 2),
            "launch/floor": round(med["launch"] / med["floor"], 2),
            "launch_sequential/launch": round(med["launch_sequential"] / med["launch"], 2),
        },
        "controller_logins_per_node": counted,
    }


def measure_env(repeats: int) -> dict[str, object]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "hostfile").write_text("10.255.0.1\n10.255.0.2\n")
        bare = [
            timed(lambda: check([sys.executable, "-c", "import netifaces"])) for _ in range(repeats)
        ]
        env = [
            timed(lambda: check([*MESHKIT, "env", "--node-rank", "1"], cwd=tmp))
            for _ in range(repeats)
        ]
    b, e = statistics.median(bare), statistics.median(env)
    return {
        "bare_import_netifaces_s": round(b, 4),
        "meshkit_env_s": round(e, 4),
        "env/bare": round(e / b, 2),
    }


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["nodes"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("floor", "floor: one parallel round of ssh logins"),
        ("mesh_no_verify", "meshkit mesh --no-verify"),
        ("mesh", "meshkit mesh (with N×N verify)"),
        ("seed", "seed: sequential N + N² logins"),
    ):
        ax.plot(ns, [r["median_s"][key] for r in rows], marker="o", label=label)  # type: ignore[index]
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("wall time, median (s)")
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("meshkit mesh vs the seed's algorithm, sandbox nodes on one machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict[str, object]]) -> str:
    head = (
        "N",
        "floor",
        "mesh",
        "mesh -no-verify",
        "seed",
        "launch",
        "launch seq",
        "mesh/floor",
        "mesh-nv/floor",
        "seed/mesh",
        "launch/floor",
        "logins/node mesh",
        "logins/node seed",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        m, q, c = r["median_s"], r["ratios"], r["controller_logins_per_node"]  # type: ignore[index]
        lines.append(
            " | ".join(
                str(x)
                for x in (
                    r["nodes"],
                    m["floor"],
                    m["mesh"],
                    m["mesh_no_verify"],
                    m["seed"],
                    m["launch"],
                    m["launch_sequential"],
                    q["mesh/floor"],
                    q["mesh_no_verify/floor"],
                    q["seed/mesh"],
                    q["launch/floor"],
                    "/".join(map(str, c["mesh"])),
                    "/".join(map(str, c["seed"])),
                )
            )
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--nodes", default="2,4,8,16", help="comma list of cluster sizes")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmarks build sandbox clusters: run as root")
    rows = [measure_n(int(n), args.repeats) for n in args.nodes.split(",")]
    env = measure_env(max(5, args.repeats * 3))
    machine = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "machine": platform.machine(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.json").write_text(
        json.dumps({"machine": machine, "mesh": rows, "env": env}, indent=2) + "\n"
    )
    plot(rows, RESULTS / "mesh_scaling.png")
    print(table(rows))
    print(f"\nenv: {env}")
    print(f"machine: {machine}")
    print(f"wrote {RESULTS / 'results.json'} and {RESULTS / 'mesh_scaling.png'}")


if __name__ == "__main__":
    main()
