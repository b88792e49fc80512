"""Plots and the README table from a results.json document, without measuring anything."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from . import stats

OPERATIONS = {
    "mesh": "mesh (until strict all-pairs logins work)",
    "round": "one round on every node",
    "check": "check (N×N)",
    "doctor": "doctor",
    "train_running": "launch: every session running",
    "train_done": "launch: every rank done (gloo all_reduce, 2 per node)",
}


def series(doc: Mapping[str, object], field: str) -> dict[str, list[tuple[int, float]]]:
    """``op/tool`` -> [(N, value)] over the sizes where it has a value."""
    rows = doc.get("sizes")
    assert isinstance(rows, list)
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.get(field, {}).items():
            if v is not None:
                out.setdefault(k, []).append((int(r["nodes"]), float(v)))
    return out


def style(k: str, index: int) -> dict[str, object]:
    """meshkit solid, the peers and baselines dashed; tab20 colors so 18 series stay apart."""
    import matplotlib

    tool = k.split("/", 1)[1]
    return {
        "color": matplotlib.colormaps["tab20"](index % 20),
        "linestyle": "-" if tool.startswith("meshkit") else "--",
        "marker": "o",
    }


def plot(doc: Mapping[str, object], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {stats.key(op, tool): label for op, tool, label in stats.COLUMNS}
    medians = series(doc, "median_s")
    floor = medians.get(stats.key("round", "floor"), [])
    sizes = sorted({n for points in medians.values() for n, _ in points})
    ops = [op for op in OPERATIONS if any(k.startswith(op + "/") for k in medians)]
    written = []
    if ops:
        fig, axes = plt.subplots(len(ops), 1, figsize=(7, 3.6 * len(ops)), squeeze=False)
        for ax, op in zip(axes[:, 0], ops):
            for i, (k, points) in enumerate(sorted(medians.items())):
                if k.startswith(op + "/"):
                    ax.plot(*zip(*points), label=labels.get(k, k), **style(k, i))
            if op != "round" and floor:
                ax.plot(*zip(*floor), linestyle=":", color="gray", label="floor")
            ax.set_title(OPERATIONS[op])
            ax.set_xlabel("nodes (N)")
            ax.set_ylabel("median wall time (s)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "time_vs_n.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    ratios = series(doc, "ratio_to_floor")
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (k, points) in enumerate(sorted(ratios.items())):
        if k != stats.key("round", "floor"):
            ax.plot(*zip(*points), label=labels.get(k, k), **style(k, i))  # type: ignore[arg-type]
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.axhline(1.3, color="red", linestyle="--", linewidth=0.8, label="target 1.3× (N=64)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("median time / floor")
    ax.set_title("ratio to the floor (one parallel round of ssh true)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "ratio_to_floor.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def render(doc: Mapping[str, object], out_dir: Path) -> str:
    """Draw the plots into out_dir; the text to print: table, env, machine, skips and failures."""
    written = plot(doc, out_dir)
    lines = [stats.table(doc), ""]
    env = doc.get("env")
    if isinstance(env, dict):
        lines.append(
            f"meshkit env {env['meshkit_env_s']} s vs bare import {env['bare_import_netifaces_s']} s: "
            f"{env['env/bare']}×"
        )
    lines.append(f"machine: {doc.get('machine')}")
    peers = doc.get("peers")
    if isinstance(peers, dict):
        for peer, why in peers.get("unavailable", {}).items():
            lines.append(f"not measured: {peer}: {why}")
    rows = doc.get("sizes")
    if isinstance(rows, list):
        for r in rows:
            for k, msgs in r.get("failures", {}).items():
                lines.append(f"N={r['nodes']} {k} FAILED: {msgs[0][:200]}")
    lines.append("wrote " + ", ".join(str(p) for p in written))
    return "\n".join(lines)
