"""Shells per node and phase times of `meshkit mesh` on a sandbox, against the one-login floor.

Not a test (pytest does not collect it): run as root from the repository root,

    MESHKIT_TEST_PREFIX=m .venv/bin/python tests/measure_mesh.py --nodes 8 [--slow-bashrc]
        [--sftp-server] [--rounds 3]

``--slow-bashrc`` gives every node a ~/.bashrc that burns 0.1 s of CPU with no interactive guard,
as ``conda init`` or ``pyenv init`` do on most ML nodes; every bashrc (slow or not) appends a line
to the node's /tmp/meshkit-shells, so the shells each node starts are counted either way.
``--sftp-server`` makes sshd run the SFTP subsystem as /usr/lib/openssh/sftp-server (through the
user's shell, as Debian's and Ubuntu's default sshd_config does) instead of internal-sftp.
Each round starts from fresh ~/.ssh directories: the floor (one parallel round of OpenSSH
``ssh node true``), ``mesh --no-verify``, a fresh ~/.ssh again, then ``mesh`` with its verify.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import named, sandbox_dir

from meshkit import sandbox

COUNT = "/tmp/meshkit-shells"
BASHRC = (
    "# measure_mesh.py: count this shell, then (slow) burn 0.1 s of CPU as conda/pyenv init do\n"
    f"printf '%s\\n' \"${{BASH_EXECUTION_STRING%%[[:space:]]*}}\" >> {COUNT}\n"
)
SLOW = "python3 -c 'import time\nwhile time.process_time() < 0.1: pass'\n"


def reset(lay: sandbox.Layout, bootstrap: str) -> None:
    """Every node's ~/.ssh as the sandbox made it: the bootstrap key only; the counters emptied."""
    for n in lay.nodes:
        d = lay.node_dir(n) / "ssh"
        for p in d.iterdir():
            p.unlink()
        (d / "authorized_keys").write_text(bootstrap)
        (d / "authorized_keys").chmod(0o600)
        (lay.node_dir(n) / "tmp" / COUNT.rsplit("/", 1)[1]).write_text("")


def shells(lay: sandbox.Layout) -> tuple[list[int], dict[str, int]]:
    counts = []
    kinds = {}
    for n in lay.nodes:
        lines = (lay.node_dir(n) / "tmp" / COUNT.rsplit("/", 1)[1]).read_text().splitlines()
        counts.append(len(lines))
        for line in lines:
            kinds[line or "(none)"] = kinds.get(line or "(none)", 0) + 1
    return counts, kinds


def floor(lay: sandbox.Layout) -> float:
    def one(n: sandbox.layout.Node) -> int:
        argv = ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", n.name, "true"]
        return subprocess.run(argv, capture_output=True, check=False).returncode

    start = time.monotonic()
    with ThreadPoolExecutor(len(lay.nodes)) as pool:
        codes = list(pool.map(one, lay.nodes))
    took = time.monotonic() - start
    assert not any(codes), codes
    return took


def mesh(lay: sandbox.Layout, *args: str, tree: str = "") -> tuple[float, dict[str, float]]:
    """``meshkit mesh``: this checkout's, or with ``tree`` the package under that directory."""
    argv = [str(Path(sys.executable).parent / "meshkit"), "mesh", "--hostfile", str(lay.hostfile)]
    env = dict(os.environ)
    if tree:
        argv[0:1] = [sys.executable, "-m", "meshkit"]
        env["PYTHONPATH"] = tree
    start = time.monotonic()
    done = subprocess.run(
        [*argv, *args], capture_output=True, text=True, check=False, env=env, cwd=tree or None
    )
    took = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    phases = {
        m[1]: float(m[2])
        for m in re.finditer(r"^\s+(\w+)\s+\d+/\d+.*\(([\d.]+)s\)", done.stderr, re.M)
    }
    return took, phases


ANSIBLE = Path("/var/tmp/meshkit-bench-peers/ansible-core/venv/bin/ansible-playbook")


def ansible_and_check(lay: sandbox.Layout) -> tuple[float, float]:
    """The benchmark's Ansible mesh (its playbook, unchanged), then a separate all-pairs check:
    from every node at once, OpenSSH to every node by the hostfile spelling (BatchMode, strict
    host keys). Both times."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from benchmarks import peers
    from meshkit.discovery import read_hosts
    from meshkit.verifyplan import parse_verify, verify_script

    with tempfile.TemporaryDirectory(prefix="measure-ansible-") as tmp:
        work = Path(tmp)
        playbook = peers.ansible_files(
            work, [n.name for n in lay.nodes], [n.address for n in lay.nodes]
        )
        start = time.monotonic()
        subprocess.run(
            [str(ANSIBLE), "-i", str(work / "inventory.ini"), str(playbook)],
            env=peers.ansible_env(work, lay.ssh_config, lay.count),
            capture_output=True,
            check=True,
        )
        mid = time.monotonic()
    hosts = read_hosts(lay.hostfile)

    def one(i: int) -> list[object]:
        argv = ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", lay.nodes[i].name, "sh"]
        script = verify_script(hosts, 10, i, {})
        out = subprocess.run(argv, input=script, capture_output=True, text=True, check=False)
        return list(parse_verify(hosts[i], hosts, out.stdout, {}))

    with ThreadPoolExecutor(len(lay.nodes)) as pool:
        failures = [f for got in pool.map(one, range(len(lay.nodes))) for f in got]
    assert not failures, failures[:3]
    return mid - start, time.monotonic() - mid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slow-bashrc", action="store_true")
    ap.add_argument("--sftp-server", action="store_true")
    ap.add_argument(
        "--compare",
        default="",
        help="a directory holding another meshkit package (e.g. `git archive OLD meshkit`): "
        "its mesh runs in the same rounds, right after this checkout's",
    )
    ap.add_argument("--no-verify-only", action="store_true")
    ap.add_argument(
        "--ansible",
        action="store_true",
        help="also the benchmark's Ansible mesh plus a separate all-pairs check, on fresh ~/.ssh",
    )
    opts = ap.parse_args()
    name = named("shell")
    lay = sandbox.up(sandbox_dir(name), sandbox.default_subnet("", name), opts.nodes, name)
    try:
        for n in lay.nodes:
            (lay.node_dir(n) / "bashrc").write_text(BASHRC + (SLOW if opts.slow_bashrc else ""))
            if opts.sftp_server:
                conf = lay.node_dir(n) / "etc_ssh" / "sshd_config"
                conf.write_text(
                    conf.read_text().replace(
                        "Subsystem sftp internal-sftp",
                        "Subsystem sftp /usr/lib/openssh/sftp-server",
                    )
                )
        if opts.sftp_server:
            for n in lay.nodes:
                sandbox.reboot(lay, n.index)
        bootstrap = lay.key.with_suffix(".pub").read_text()
        rows: dict[str, list[float]] = {}
        counted: dict[str, tuple[list[int], dict[str, int]]] = {}
        for _ in range(opts.rounds):
            reset(lay, bootstrap)
            rows.setdefault("floor", []).append(floor(lay))
            counted["floor"] = shells(lay)
            base = rows["floor"][-1]
            if opts.ansible:
                reset(lay, bootstrap)
                meshed, checked = ansible_and_check(lay)
                rows.setdefault("ansible mesh + all-pairs check", []).append(meshed + checked)
                rows.setdefault("  ansible mesh", []).append(meshed)
                rows.setdefault("  all-pairs check", []).append(checked)
                counted["ansible mesh + all-pairs check"] = shells(lay)
            for tag, tree in (("", ""), (" [compared]", opts.compare)):
                if tag and not tree:
                    continue
                reset(lay, bootstrap)
                took, phases = mesh(lay, "--no-verify", tree=tree)
                counted["mesh --no-verify" + tag] = shells(lay)
                rows.setdefault("mesh --no-verify" + tag, []).append(took)
                rows.setdefault("  ratio to floor" + tag, []).append(took / base)
                for k, v in phases.items():
                    rows.setdefault(f"  {k}{tag}", []).append(v)
                if opts.no_verify_only:
                    continue
                reset(lay, bootstrap)
                took, phases = mesh(lay, tree=tree)
                counted["mesh" + tag] = shells(lay)
                rows.setdefault("mesh" + tag, []).append(took)
                rows.setdefault("  verify" + tag, []).append(phases.get("verify", 0.0))
                took, _ = mesh(lay, "--no-verify", tree=tree)
                rows.setdefault("mesh --no-verify (meshed)" + tag, []).append(took)
        bashrc = "slow (0.1 s CPU)" if opts.slow_bashrc else "empty"
        sftp = "sftp-server" if opts.sftp_server else "internal-sftp"
        print(f"N={opts.nodes} bashrc={bashrc} sftp={sftp}; medians of {opts.rounds}")
        for k, v in rows.items():
            unit = "x" if "ratio" in k else "s"
            print(
                f"  {k:<40} {statistics.median(v):6.2f}{unit}   {' '.join(f'{x:.2f}' for x in v)}"
            )
        for k, (counts, kinds) in counted.items():
            print(f"  shells per node, {k}: {counts}  by command: {kinds}")
    finally:
        sandbox.down(sandbox_dir(name), name)


if __name__ == "__main__":
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    main()
