"""The pure part of the benchmark: medians, ratios to the floor, the README table, and the parsers
that decide whether a tool really reached its end state. No I/O here (unit-tested without mocks)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

# One timed sample: seconds, or None when the run failed or was skipped (the reason is kept apart).
Sample = Union[float, None]

# (operation, tool) pairs in table order; the label is what the README shows.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("round", "floor", "floor (ssh true ×N)"),
    ("mesh", "meshkit_no_verify", "mesh --no-verify"),
    ("mesh", "meshkit", "mesh (verify)"),
    ("mesh", "ansible", "Ansible mesh"),
    ("mesh", "ansible_check", "Ansible mesh + check"),
    ("mesh", "bash_controlmaster", "bash+ControlMaster mesh"),
    ("mesh", "seed", "seed script"),
    ("check", "meshkit", "check"),
    ("round", "meshkit_status", "status"),
    ("round", "meshkit_diagnose", "diagnose"),
    ("round", "meshkit_logs", "logs"),
    ("round", "meshkit_stop", "stop"),
    ("round", "pdsh", "pdsh"),
    ("round", "clush", "clush -b"),
    ("doctor", "meshkit_quick", "doctor --quick"),
    ("doctor", "meshkit", "doctor"),
    ("doctor", "meshkit_bandwidth", "doctor --bandwidth"),
    ("train_running", "meshkit", "train: sessions up"),
    ("train_done", "meshkit", "train: ranks done"),
    ("train_running", "meshkit_spawn", "train --spawn: sessions up"),
    ("train_done", "meshkit_spawn", "train --spawn: ranks done"),
    ("train_done", "pdsh_torchrun", "pdsh+torchrun done"),
    ("train_done", "torchrunx", "torchrunx done"),
)

# The example job's line (meshkit/templates/example_train.py). node_rank is torchrun's GROUP_RANK,
# meshkit_node_rank is meshkit's NODE_RANK ("None" where the launcher is not meshkit).
RESULT = re.compile(
    r"meshkit-example rank=(?P<rank>\d+) world_size=(?P<world>\d+) node_rank=(?P<group>\S+) "
    r"meshkit_node_rank=(?P<node_rank>\S+) local_rank=(?P<local>\S+) host=(?P<host>\S+) "
    r"sum=(?P<sum>-?\d+) expected=(?P<expected>\d+)"
)


def median(samples: Iterable[Sample]) -> float | None:
    """Median of the successful samples; None if there is none (a failed variant has no time)."""
    ok = [s for s in samples if s is not None]
    return statistics.median(ok) if ok else None


def ratio(value: float | None, floor: float | None) -> float | None:
    if value is None or floor is None or floor <= 0:
        return None
    return round(value / floor, 2)


def key(op: str, tool: str) -> str:
    return f"{op}/{tool}"


FLOOR = key("round", "floor")
ANSIBLE_CHECK = key("mesh", "ansible_check")  # Ansible's mesh + meshkit check on its cluster
# The operations whose work is per node (one round of logins, whatever N): their ratio to the
# floor is the figure the sweep takes to the largest N.
PER_NODE_OPS = (
    key("mesh", "meshkit_no_verify"),
    key("train_running", "meshkit"),
    key("round", "meshkit_status"),
    key("round", "meshkit_diagnose"),
    key("round", "meshkit_stop"),
    key("doctor", "meshkit_quick"),
)


def summarize(
    raw: Mapping[str, Sequence[Sample]],
    cluster: Mapping[str, Sequence[str]] | None = None,
    floors: Mapping[str, float | None] | None = None,
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Medians per ``op/tool`` and their ratios to the floor. With ``cluster`` (each sample's
    cluster) and ``floors`` (each cluster's floor), a ratio is the median of each sample over
    its own cluster's floor, measured in the same repeat: a fresh cluster and a meshed one
    differ, so a pooled floor misstates both. Without them (results stored without clusters), the
    ratio of the medians."""
    medians: dict[str, float | None] = {}
    for name, values in raw.items():
        middle = median(values)
        medians[name] = None if middle is None else round(middle, 3)
    if cluster is None or floors is None:
        floor = medians.get(FLOOR)
        return medians, {k: ratio(m, floor) for k, m in medians.items()}
    ratios: dict[str, float | None] = {}
    for k, samples in raw.items():
        if k == FLOOR:
            ratios[k] = 1.0 if medians.get(k) is not None else None
            continue
        paired = []
        for sample, sample_cluster in zip(samples, cluster.get(k, ())):
            sample_ratio = ratio(sample, floors.get(sample_cluster))
            if sample_ratio is not None:
                paired.append(sample_ratio)
        ratios[k] = None if not paired else round(statistics.median(paired), 2)
    return medians, ratios


def shells_summary(shells: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, dict[str, float]]:
    """Shells started per node by each operation: the median over samples of the mean over nodes,
    and the most any node started in any sample."""
    out = {}
    for k, samples in shells.items():
        means = [sum(s) / len(s) for s in samples if s]
        if means:
            out[k] = {
                "mean": round(statistics.median(means), 2),
                "max": max(max(s) for s in samples if s),
            }
    return out


def sampled_pairs(row: Mapping[str, object], k: str) -> tuple[int, int] | None:
    """(pairs checked, pairs in the cluster) when ``k``'s end-state check covered only a sample
    of the cluster's pairs (above --n2-max); None when it covered them all or there was none."""
    checked = row.get("pairs_checked")
    if not isinstance(checked, Mapping):
        return None
    for pairs, of in checked.get(k, []):
        if pairs < of:
            return pairs, of
    return None


def _cell(seconds: float | None, r: float | None, skipped: str | None) -> str:
    if seconds is None:
        return "–" if skipped else "failed"
    return f"{seconds:.2f}" if r is None else f"{seconds:.2f} ({r:.2f}×)"


SAMPLED = "ˢ"  # beside a figure whose end state was checked on a sample of the pairs


def table(results: Mapping[str, object], columns: Sequence[tuple[str, str, str]] = COLUMNS) -> str:
    """The table from a results.json document: one row per N, one column per measured
    (operation, tool), each cell "median s (ratio to the floor x)"; a dash where skipped, and
    ``ˢ`` where the end-state check covered only a sample of the pairs (a note under the table
    says how many)."""
    rows = results.get("sizes")
    assert isinstance(rows, list)
    present = [c for c in columns if any(key(c[0], c[1]) in r.get("median_s", {}) for r in rows)]
    head = ["N", *(label for _, _, label in present)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: dict[int, tuple[int, int]] = {}
    for r in rows:
        med = r.get("median_s", {})
        rat = r.get("ratio_to_floor", {})
        skip = r.get("skipped", {})
        cells = [str(r["nodes"])]
        for op, tool, _ in present:
            k = key(op, tool)
            # Not measured at this N at all (skipped with its variant): a dash, not "failed".
            why = skip.get(k) or ("not measured" if k not in med else None)
            cell = _cell(med.get(k), rat.get(k) if tool != "floor" else None, why)
            sample = sampled_pairs(r, k)
            if sample is not None and med.get(k) is not None:
                cell += SAMPLED
                notes[int(r["nodes"])] = sample
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        lines.append(
            f"{SAMPLED} end state checked on a sample of the pairs (above --n2-max): "
            + "; ".join(f"N={n}: {p} of {of} pairs" for n, (p, of) in sorted(notes.items()))
            + "."
        )
    return "\n".join(lines)


# The headline: what a user compares, in few columns.
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("round", "floor", "floor (ssh true ×N), s"),
    ("mesh", "meshkit_no_verify", "mesh --no-verify"),
    ("mesh", "meshkit", "mesh (verify)"),
    ("mesh", "ansible_check", "Ansible mesh + check"),
    ("train_running", "meshkit", "train: sessions up"),
    ("round", "meshkit_status", "status"),
    ("round", "meshkit_stop", "stop"),
    ("doctor", "meshkit_quick", "doctor --quick"),
)


def headline(results: Mapping[str, object]) -> str:
    """The short table for the project README: the per-node operations and the mesh against
    Ansible's, each "median s (ratio to its own cluster's floor x)"."""
    return table(results, HEADLINE)


def shells_table(results: Mapping[str, object]) -> str:
    """Shells each node started per operation (mean over nodes, median over samples; the most
    any node started in brackets where it differs): what a conda-like ~/.bashrc is paid for."""
    rows = results.get("sizes")
    assert isinstance(rows, list)
    present = [
        c for c in COLUMNS if any(key(c[0], c[1]) in r.get("shells_per_node", {}) for r in rows)
    ]
    if not present:
        return ""
    head = ["N", *(label for _, _, label in present)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        got = r.get("shells_per_node", {})
        cells = [str(r["nodes"])]
        for op, tool, _ in present:
            s = got.get(key(op, tool))
            if s is None:
                cells.append("–")
            else:
                mean = s["mean"]
                most = s["max"]
                cells.append(f"{mean:g}" + ("" if most == mean else f" ({most:g})"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class RankLine:
    rank: int
    world: int
    group: str
    host: str
    sum: int
    expected: int


def rank_lines(text: str) -> list[RankLine]:
    return [
        RankLine(
            int(m["rank"]),
            int(m["world"]),
            m["group"],
            m["host"],
            int(m["sum"]),
            int(m["expected"]),
        )
        for m in RESULT.finditer(text)
    ]


def launch_problems(lines: Sequence[RankLine], nodes: int, per_node: int) -> list[str]:
    """Why a launch did not reach its end state (every rank of nodes x per_node printed the right
    all_reduce sum, two ranks per host); [] when it did."""
    world = nodes * per_node
    want = world * (world + 1) // 2
    problems = []
    ranks = sorted(line.rank for line in lines)
    if ranks != list(range(world)):
        problems.append(f"ranks seen {ranks}, want 0..{world - 1}")
    problems += [
        f"rank {x.rank}: world_size={x.world} sum={x.sum}, want {world} and {want}"
        for x in lines
        if x.world != world or x.sum != want or x.expected != want
    ]
    per_host: dict[str, int] = {}
    for x in lines:
        per_host[x.host] = per_host.get(x.host, 0) + 1
    if len(per_host) != nodes or any(c != per_node for c in per_host.values()):
        problems.append(
            f"ranks per host {dict(sorted(per_host.items()))}, want {per_node} on each of {nodes}"
        )
    return problems


def answered(output: str, names: Sequence[str]) -> list[str]:
    """The node names that answered a one-round ``hostname``: every output line (``pdsh``'s
    ``node: text``, ``clush -b``'s gathered blocks) whose text is exactly one of the names."""
    seen = set()
    for line in output.splitlines():
        text = line.split(": ", 1)[1] if ": " in line else line
        if text.strip() in names:
            seen.add(text.strip())
    return [n for n in names if n in seen]


def pair_failures(check_json: Mapping[str, object]) -> list[str]:
    """``meshkit check --json``'s failures, one line each ("a -> b: why")."""
    failures = check_json.get("failures")
    if not isinstance(failures, list):
        return ["no failures list in check's JSON"]
    return [f"{f['from']} -> {f['to']}: {f['error']}" for f in failures]


_LOG_PREFIX = re.compile(r"^\[(\d+)\] ", re.M)


def log_ranks(text: str) -> list[int]:
    """The ranks whose lines ``meshkit logs`` printed (each line starts ``[rank] ``)."""
    return sorted({int(m) for m in _LOG_PREFIX.findall(text)})
