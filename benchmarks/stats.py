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
    ("mesh", "bash_controlmaster", "bash+ControlMaster mesh"),
    ("mesh", "seed", "seed script"),
    ("check", "meshkit", "check"),
    ("round", "meshkit_status", "status"),
    ("round", "meshkit_logs", "logs"),
    ("round", "meshkit_stop", "stop"),
    ("round", "pdsh", "pdsh"),
    ("round", "clush", "clush -b"),
    ("doctor", "meshkit_quick", "doctor --quick"),
    ("doctor", "meshkit", "doctor"),
    ("train_running", "meshkit", "train: sessions up"),
    ("train_done", "meshkit", "train: ranks done"),
    ("train_running", "meshkit_warm", "train, warm: sessions up"),
    ("train_done", "meshkit_warm", "train, warm: ranks done"),
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


def summarize(
    raw: Mapping[str, Sequence[Sample]],
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Medians per ``op/tool`` and each one's ratio to the floor (``round/floor``) of the same N."""
    medians = {k: (None if (m := median(v)) is None else round(m, 3)) for k, v in raw.items()}
    floor = medians.get(key("round", "floor"))
    return medians, {k: ratio(m, floor) for k, m in medians.items()}


def _cell(seconds: float | None, r: float | None, skipped: str | None) -> str:
    if seconds is None:
        return "–" if skipped else "failed"
    return f"{seconds:.2f}" if r is None else f"{seconds:.2f} ({r:.2f}×)"


def table(results: Mapping[str, object]) -> str:
    """The README table from a results.json document: one row per N, one column per measured
    (operation, tool), each cell "median s (ratio to the floor x)"; a dash where skipped."""
    rows = results.get("sizes")
    assert isinstance(rows, list)
    present = [c for c in COLUMNS if any(key(c[0], c[1]) in r.get("median_s", {}) for r in rows)]
    head = ["N", *(label for _, _, label in present)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        med, rat, skip = r.get("median_s", {}), r.get("ratio_to_floor", {}), r.get("skipped", {})
        cells = [str(r["nodes"])]
        for op, tool, _ in present:
            k = key(op, tool)
            cells.append(_cell(med.get(k), rat.get(k) if tool != "floor" else None, skip.get(k)))
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
