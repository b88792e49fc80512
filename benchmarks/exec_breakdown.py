"""Where ``meshkit exec``'s wall time goes, against pdsh, on one sandbox of N nodes.

``python -m benchmarks.exec_breakdown [--nodes 8] [--repeats 5] [--out DIR]`` (root; run
``benchmarks.exec_peers`` first: it installs the meshkit wheel this uses) times, in a rotating
order, N parallel rounds of steps that each add one piece of exec's path:
- ``ssh_true``: ``ssh node true`` (the floor: the handshake, the login, the user's shell);
- ``ssh_python``: ``ssh node PYTHON -c pass`` (+ the node's interpreter start);
- ``ssh_agent_start``: ``ssh node PYTHON -m meshkit.node serve </dev/null`` (+ the agent's
  imports; it ends at once on its closed stdin);
- ``ssh_agent_exec``: the agent over ``ssh`` answering one ``exec`` request for ``hostname``
  (+ the op: the variables, bash and its ~/.bashrc, the command): exec's node side, with
  OpenSSH's client in place of meshkit's controller;
- ``paramiko``: one Python process that imports paramiko and runs ``hostname`` on every node
  over strictly verified paramiko connections, one thread each: the floor of any controller
  built on paramiko (its import alone is timed inside it, ``paramiko_import``);
- ``pdsh`` and ``meshkit`` (``meshkit exec --cmd hostname``), as ``exec_peers`` runs them.
Writes ``OUT/breakdown.json`` (default ``benchmarks/results/exec-peers``) and prints the
medians and the differences between neighbouring steps.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from meshkit import protocol, sandbox
from meshkit.sandbox.bashrc import reset_shells
from meshkit.sandbox.bashrc import shells as counted_shells
from meshkit.sandbox.layout import default_subnet

from . import exec_peers, peers
from .harness import RESULTS, commit, machine

PARAMIKO_FLOOR = """
import sys, threading, time
start = time.perf_counter()
import paramiko
imported = time.perf_counter() - start
key, known_hosts, user, command, *addresses = sys.argv[1:]
outputs = {}

def one(address):
    client = paramiko.SSHClient()
    client.load_host_keys(known_hosts)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(address, username=user, key_filename=key, allow_agent=False,
                   look_for_keys=False, timeout=30)
    _, out, _ = client.exec_command(command)
    outputs[address] = out.read().decode()
    client.close()

threads = [threading.Thread(target=one, args=(address,)) for address in addresses]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert len(outputs) == len(addresses), sorted(set(addresses) - set(outputs))
print("".join(outputs.values()), end="")
print(f"paramiko_import {imported:.4f}", file=sys.stderr)
"""

STEPS = (
    "ssh_true",
    "ssh_python",
    "ssh_agent_start",
    "ssh_agent_exec",
    "paramiko",
    "pdsh",
    "meshkit",
)


def ssh(lay: sandbox.Layout) -> list[str]:
    return ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes"]


def agent_exec(lay: sandbox.Layout, python: str, limit: float) -> float:
    """Every node's agent started over ``ssh`` and asked one ``exec`` of ``hostname``, at once;
    the wall time until the last reply."""
    start = time.perf_counter()
    serve = shlex.join([python, "-m", "meshkit.node", "serve"])
    procs = []
    for rank, node in enumerate(lay.nodes):
        request = protocol.ExecRequest(
            cmd=exec_peers.COMMAND,
            node_rank=rank,
            nnodes=lay.count,
            master_addr=lay.nodes[0].address,
            master_port=29500,
            session="bench",
            timeout=limit,
            nproc_per_node=1,
        )
        process = subprocess.Popen(
            [*ssh(lay), node.name, serve],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert process.stdin is not None
        process.stdin.write(protocol.encode_request(request).encode())
        process.stdin.flush()
        procs.append(process)
    for process in procs:
        assert process.stdout is not None and process.stdin is not None
        reply = protocol.decode_reply("exec", process.stdout.readline().decode())
        if not isinstance(reply, protocol.ExecReply) or reply.exit_code != 0:
            raise RuntimeError(f"exec over ssh failed: {reply}")
        process.stdin.close()
    wall = time.perf_counter() - start
    for process in procs:
        process.wait(timeout=limit)
    return wall


def step(
    name: str, lay: sandbox.Layout, bins: dict[str, Path], limit: float
) -> tuple[float, float | None]:
    """One round of ``name`` on every node: its wall seconds, and paramiko's import seconds
    (the ``paramiko`` step only)."""
    python = str(bins["meshkit"] / "python")
    names = [node.name for node in lay.nodes]
    remote = {
        "ssh_true": "true",
        "ssh_python": f"{python} -c pass",
        "ssh_agent_start": f"{python} -m meshkit.node serve </dev/null",
    }
    if name in remote:
        argvs = [[*ssh(lay), node, remote[name]] for node in names]
        wall, _, _ = exec_peers.timed(argvs, None, limit)
        return wall, None
    if name == "ssh_agent_exec":
        return agent_exec(lay, python, limit), None
    if name == "paramiko":
        user = "root"
        addresses = [node.address for node in lay.nodes]
        argv = [
            python,
            "-c",
            PARAMIKO_FLOOR,
            str(lay.key),
            str(lay.known_hosts),
            user,
            exec_peers.COMMAND,
            *addresses,
        ]
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=True)
        wall = time.perf_counter() - start
        imported = float(done.stderr.split("paramiko_import")[-1])
        return wall, imported
    argv = exec_peers.tool_argv(name, lay, bins)
    wall, _, _ = exec_peers.timed([argv], exec_peers.tool_env(name, lay), limit)
    return wall, None


def measure(count: int, repeats: int, bins: dict[str, Path]) -> dict[str, object]:
    lay = sandbox.up(
        exec_peers.ROOT,
        default_subnet("", exec_peers.NAME),
        count,
        exec_peers.NAME,
        bashrc=exec_peers.BASHRC,
        kex=exec_peers.KEX,
    )
    samples: dict[str, list[float]] = {name: [] for name in STEPS}
    imports: list[float] = []
    limit = 120.0 + 2.0 * count
    try:
        for repeat in range(repeats):
            order = list(STEPS[repeat % len(STEPS) :]) + list(STEPS[: repeat % len(STEPS)])
            for name in order:
                exec_peers.settle()
                wall, imported = step(name, lay, bins, limit)
                samples[name].append(wall)
                if imported is not None:
                    imports.append(imported)
                print(f"N={count} r{repeat + 1} {name}: {wall:.3f}s", file=sys.stderr, flush=True)
        shells = {name: shells_started(name, lay, bins, limit) for name in ("pdsh", "meshkit")}
    finally:
        sandbox.down(exec_peers.ROOT, exec_peers.NAME)
    medians = {name: round(statistics.median(values), 4) for name, values in samples.items()}
    return {
        "nodes": count,
        "samples": samples,
        "medians_s": medians,
        "paramiko_import_s": round(statistics.median(imports), 4),
        "shells_node0": shells,
    }


def shells_started(
    name: str, lay: sandbox.Layout, bins: dict[str, Path], limit: float
) -> list[str]:
    """The shells one round of ``name`` started on node0 (what each was started for), as the
    sandbox's bashrc counts them."""
    reset_shells(lay)
    step(name, lay, bins, limit)
    return counted_shells(lay)[0]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.exec_breakdown", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "exec-peers"))
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parent.parent
    bins = {"meshkit": peers.install_meshkit(repo)}
    row = measure(args.nodes, args.repeats, bins)
    results = {"command": exec_peers.COMMAND, "bashrc": exec_peers.BASHRC, "row": row}
    results["commit"] = commit()
    results["machine"] = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "breakdown.json").write_text(json.dumps(results, indent=2) + "\n")
    medians = row["medians_s"]
    assert isinstance(medians, dict)
    previous = None
    for name in STEPS:
        added = "" if previous is None else f"  (+{medians[name] - medians[previous]:.3f})"
        print(f"{name:16s} {medians[name]:.3f} s{added}")
        previous = name
    print(f"paramiko's import alone: {row['paramiko_import_s']:.3f} s")
    print(f"shells on node0: {row['shells_node0']}")
    print(f"written: {out / 'breakdown.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
