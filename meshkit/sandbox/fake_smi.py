"""A fake ``nvidia-smi`` for sandbox nodes that ``sandbox.fault --gpus N`` gives GPUs: copied, as
it is, into the node's own program directory beside its state (``nvidia-smi.json``: each GPU's
fields and their values) and run there as the real one would be. It answers ``-L``, and
``--query-gpu=FIELDS --format=csv[,noheader][,nounits]`` for any field list: a value for each
field a GPU has, ``[N/A]`` for the others (top's readings and the health query included).

Standard library only, and no import of meshkit: the node runs this file by itself. The answers
are pure functions of the state (``list_gpus``, ``query``), which the unit tests check.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass

STATE_FILE = "nvidia-smi.json"  # beside the program
NAME = "NVIDIA H100 80GB HBM3"
# An 8-GPU H100 board's bus numbers, as such machines show them.
BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
NOT_AVAILABLE = "[N/A]"
NO_DEVICES = 6  # nvidia-smi's exit code when it finds no GPU
BAD_ARGUMENTS = 2
ECC_FIELDS = ("ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total")
# The unit a field's value is in, shown without ``nounits`` (and in the header).
UNITS = {
    "memory.total": "MiB",
    "memory.used": "MiB",
    "memory.free": "MiB",
    "power.draw": "W",
    "power.limit": "W",
    "utilization.gpu": "%",
    "utilization.memory": "%",
}
THROTTLES = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "sw_power_cap")


def bus(index: int) -> str:
    """GPU ``index``'s PCI bus number (two hex digits)."""
    if index < len(BUSES):
        return BUSES[index]
    return f"{(0xDB + index) % 0x100:02x}"


def short_pci(index: int) -> str:
    """GPU ``index``'s PCI address as the kernel log's XID lines name it: ``0000:18:00``."""
    return f"0000:{bus(index)}:00"


def healthy_gpu(node: str, index: int) -> dict[str, str]:
    """The fields of a healthy H100 ``index`` of ``node``: a UUID of its own, its bus, no ECC
    error, its PCIe link at full width and generation, no throttling, idle."""
    digest = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    uuid = f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
    fields = {
        "index": str(index),
        "name": NAME,
        "uuid": uuid,
        "pci.bus_id": f"00000000:{bus(index).upper()}:00.0",
        "driver_version": "550.90.07",
        "compute_cap": "9.0",
        "persistence_mode": "Enabled",
        "memory.total": "81559",
        "memory.used": "0",
        "memory.free": "81559",
        "utilization.gpu": "0",
        "utilization.memory": "0",
        "power.draw": "71.23",
        "power.limit": "700.00",
        "temperature.gpu": "33",
        "ecc.errors.corrected.volatile.total": "0",
        "remapped_rows.correctable": "0",
        "remapped_rows.uncorrectable": "0",
        "remapped_rows.pending": "No",
        "remapped_rows.failure": "No",
        "retired_pages.pending": "No",
        "pcie.link.width.current": "16",
        "pcie.link.width.max": "16",
        "pcie.link.gen.current": "5",
        "pcie.link.gen.max": "5",
        "clocks_throttle_reasons.active": "0x0000000000000000",
        "clocks_event_reasons.active": "0x0000000000000000",
    }
    for field in ECC_FIELDS:
        fields[field] = "0"
    # Newer drivers call the throttle reasons "event reasons"; both names answer.
    for reason in THROTTLES:
        fields[f"clocks_throttle_reasons.{reason}"] = "Not Active"
        fields[f"clocks_event_reasons.{reason}"] = "Not Active"
    return fields


def gpus_state(node: str, count: int, ecc: int) -> dict[str, list[dict[str, str]]]:
    """The fake's state for ``count`` healthy GPUs of ``node``, GPU 0 with ``ecc`` uncorrected
    ECC errors."""
    gpus = [healthy_gpu(node, index) for index in range(count)]
    if gpus:
        for field in ECC_FIELDS:
            gpus[0][field] = str(ecc)
    for gpu in gpus:
        gpu["count"] = str(count)
    return {"gpus": gpus}


def list_gpus(gpus: list[dict[str, str]]) -> str:
    """``nvidia-smi -L``."""
    lines = []
    for gpu in gpus:
        lines.append(f"GPU {gpu['index']}: {gpu['name']} (UUID: {gpu['uuid']})\n")
    return "".join(lines)


@dataclass(frozen=True)
class CsvFormat:
    header: bool = True
    units: bool = True


def parse_format(text: str) -> CsvFormat | None:
    """``--format=``'s value; None unless it is csv with known options."""
    options = [option.strip() for option in text.split(",")]
    if options[0] != "csv" or not set(options[1:]) <= {"noheader", "nounits"}:
        return None
    return CsvFormat(header="noheader" not in options, units="nounits" not in options)


def query(gpus: list[dict[str, str]], fields: list[str], form: CsvFormat) -> str:
    """``nvidia-smi --query-gpu=FIELDS --format=csv...``: a line per GPU, its values in the order
    asked, ``[N/A]`` for a field it has not got."""
    lines = []
    if form.header:
        names = []
        for field in fields:
            unit = UNITS.get(field)
            if unit and form.units:
                names.append(f"{field} [{unit}]")
            else:
                names.append(field)
        lines.append(", ".join(names))
    for gpu in gpus:
        values = []
        for field in fields:
            value = gpu.get(field, NOT_AVAILABLE)
            unit = UNITS.get(field)
            if unit and form.units and value != NOT_AVAILABLE:
                value = f"{value} {unit}"
            values.append(value)
        lines.append(", ".join(values))
    return "".join(f"{line}\n" for line in lines)


@dataclass(frozen=True)
class Answer:
    out: str
    err: str
    code: int


def answer(argv: list[str], gpus: list[dict[str, str]]) -> Answer:
    """What nvidia-smi answers ``argv`` with on a node of ``gpus``."""
    fields: list[str] | None = None
    form = CsvFormat()
    listing = False
    chosen: set[str] | None = None
    words = list(argv)
    while words:
        word = words.pop(0)
        if word in ("-L", "--list-gpus"):
            listing = True
        elif word.startswith("--query-gpu="):
            fields = [field.strip() for field in word.split("=", 1)[1].split(",")]
        elif word.startswith("--format="):
            parsed = parse_format(word.split("=", 1)[1])
            if parsed is None:
                return Answer("", f"'{word}' is not a valid format.\n", BAD_ARGUMENTS)
            form = parsed
        elif word in ("-i", "--id") and words:
            chosen = set(words.pop(0).split(","))
        elif word.startswith("--id="):
            chosen = set(word.split("=", 1)[1].split(","))
        else:
            return Answer("", f"Invalid combination of input arguments: {word}\n", BAD_ARGUMENTS)
    if not gpus:
        return Answer("No devices were found\n", "", NO_DEVICES)
    if chosen is not None:
        gpus = [gpu for gpu in gpus if gpu["index"] in chosen]
    if listing:
        return Answer(list_gpus(gpus), "", 0)
    if fields is not None:
        return Answer(query(gpus, fields, form), "", 0)
    return Answer(list_gpus(gpus), "", 0)  # the real one's table, in short


def load(path: str) -> list[dict[str, str]]:
    """The GPUs of the state file at ``path`` (none where it is missing or not the fake's)."""
    try:
        with open(path) as file:
            data = json.load(file)
    except (OSError, ValueError):
        return []
    gpus = data.get("gpus") if isinstance(data, dict) else None
    if not isinstance(gpus, list):
        return []
    return [gpu for gpu in gpus if isinstance(gpu, dict)]


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    result = answer(sys.argv[1:], load(os.path.join(here, STATE_FILE)))
    sys.stdout.write(result.out)
    sys.stderr.write(result.err)
    return result.code


if __name__ == "__main__":
    raise SystemExit(main())
