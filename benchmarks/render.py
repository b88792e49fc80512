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


def sampled_note(doc: Mapping[str, object], prefix: str = "") -> str:
    """A line naming the sizes whose end-state check covered only a sample of the pairs."""
    rows = doc.get("sizes")
    assert isinstance(rows, list)
    found = {}
    for row in rows:
        for key in row.get("pairs_checked", {}):
            if not key.startswith(prefix):
                continue
            sampled = stats.sampled_pairs(row, key)
            if sampled is not None:
                found[int(row["nodes"])] = sampled
    if not found:
        return ""
    return (
        "open marks: end state checked on a sample of pairs ("
        + ", ".join(f"N={n}: {p} of {of}" for n, (p, of) in sorted(found.items()))
        + ")"
    )


def sampled_points(
    doc: Mapping[str, object], k: str, points: list[tuple[int, float]]
) -> list[tuple[int, float]]:
    rows = doc.get("sizes")
    assert isinstance(rows, list)
    sampled = {int(r["nodes"]) for r in rows if stats.sampled_pairs(r, k) is not None}
    return [(n, v) for n, v in points if n in sampled]


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
                    sampled = sampled_points(doc, k, points)
                    if sampled:
                        ax.plot(*zip(*sampled), "o", mfc="white", color=style(k, i)["color"])
            if op != "round" and floor:
                ax.plot(*zip(*floor), linestyle=":", color="gray", label="floor")
            note = sampled_note(doc, op + "/")
            ax.set_title(OPERATIONS[op] + (f"\n{note}" if note else ""), fontsize=9)
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
            sampled = sampled_points(doc, k, points)
            if sampled:
                ax.plot(*zip(*sampled), "o", mfc="white", color=style(k, i)["color"])
    ax.axhline(1.0, color="gray", linestyle=":")
    ax.axhline(
        1.2, color="red", linestyle="--", linewidth=0.8, label="target 1.2× (mesh --no-verify)"
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("median time / floor")
    note = sampled_note(doc)
    ax.set_title(
        "ratio to the floor of the same cluster (one parallel round of ssh true)"
        + (f"\n{note}" if note else ""),
        fontsize=9,
    )
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
    lines = ["headline:", stats.headline(doc), "", "all:", stats.table(doc), ""]
    shells = stats.shells_table(doc)
    if shells:
        lines += ["shells per node per operation:", shells, ""]
    env = doc.get("env")
    if isinstance(env, dict) and "meshkit_env_s" in env:
        lines.append(
            f"meshkit env {env['meshkit_env_s']} s "
            f"vs bare import {env['bare_import_netifaces_s']} s: {env['env/bare']}×"
        )
    elif isinstance(env, dict):
        lines.append(f"meshkit env not measured: {env.get('failed')}")
    lines.append(f"measured: {doc.get('measured')}")
    lines.append(f"machine: {doc.get('machine')}")
    peers = doc.get("peers")
    if isinstance(peers, dict):
        for peer, why in peers.get("unavailable", {}).items():
            lines.append(f"not measured: {peer}: {why}")
    rows = doc.get("sizes")
    if isinstance(rows, list):
        for row in rows:
            load = row.get("machine_load")
            if load:
                lines.append(
                    f"N={row['nodes']} machine: "
                    + " -> ".join(
                        f"{point['at']} load {point['load_average_1m']}, "
                        f"{point['other_sandbox_nodes']} other sandbox nodes"
                        for point in load
                    )
                )
            for name, messages in row.get("failures", {}).items():
                lines.append(f"N={row['nodes']} {name} FAILED: {messages[0][:200]}")
    lines.append("wrote " + ", ".join(str(p) for p in written))
    return "\n".join(lines)
