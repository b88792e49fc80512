"""This node's GPU readings for ``meshkit top``: through NVML (the driver's ``libnvidia-ml.so.1``,
loaded with ctypes, as Ray and vLLM read it), else through ``nvidia-smi --query-gpu``. Standard
library only. A node without GPUs has an empty list, never an error.

Each reader only gathers the driver's raw answers; turning them into a ``GpuSample`` (units,
"not supported", "not available") is a pure function of recorded values (``decode_nvml``,
``parse_smi``), which the tests check without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass, field

from ..protocol import GpuSample
from .gpus import GPU_PROBE_TIMEOUT, _on_path, trusted_program

NVML_LIBRARY = "libnvidia-ml.so.1"
# Where NVIDIA's driver installs NVML (Debian/Ubuntu on x86-64 and arm64, RHEL/SUSE, other
# distributions, the container toolkit, WSL). Loaded from these by absolute path, never through
# the loader's search, which LD_LIBRARY_PATH (another user's directory, say) may lead elsewhere.
NVML_DIRECTORIES = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/usr/lib/wsl/lib",
)
NVML_SUCCESS = 0
NVML_TEMPERATURE_GPU = 0  # the sensor GetTemperature reads
NVML_NOT_AVAILABLE = 0xFFFFFFFF  # what NVML writes for a value it has not got
NVML_DRIVER_NOT_LOADED = 9  # nvmlInit's answer on a machine with the library but no GPU driver
NAME_BUFFER = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
MAX_GPUS = 64  # GPUs one reply carries
MIB = 1 << 20
SMI_FIELDS = (
    "index",
    "name",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "power.draw",
    "power.limit",
    "temperature.gpu",
)


@dataclass(frozen=True)
class NvmlAnswer:
    """One NVML call's return code (0: success) and the raw number it wrote."""

    code: int
    value: int


@dataclass(frozen=True)
class NvmlReadings:
    """What NVML answered for one GPU, in NVML's own units."""

    index: int
    name: str
    utilization: NvmlAnswer  # percent of the last sample period a kernel ran
    memory_used: NvmlAnswer  # bytes
    memory_total: NvmlAnswer  # bytes
    power: NvmlAnswer  # milliwatts
    power_limit: NvmlAnswer  # milliwatts
    temperature: NvmlAnswer  # degrees Celsius


@dataclass(frozen=True)
class GpuReadings:
    """This node's GPUs, which reader gave them, and why none could be read where a driver is."""

    gpus: list[GpuSample] = field(default_factory=list)
    source: str = "none"  # "nvml", "nvidia-smi" or "none"
    error: str | None = None


def _answered(answer: NvmlAnswer) -> int | None:
    if answer.code != NVML_SUCCESS or answer.value == NVML_NOT_AVAILABLE:
        return None
    return answer.value


def decode_nvml(readings: NvmlReadings) -> GpuSample:
    """Pure: NVML's raw answers as a sample (milliwatts to watts; a call that failed, or a value
    NVML marks as not available, is None; a utilisation outside 0-100 is not one)."""
    utilization = _answered(readings.utilization)
    if utilization is not None and not 0 <= utilization <= 100:
        utilization = None
    power = _answered(readings.power)
    limit = _answered(readings.power_limit)
    temperature = _answered(readings.temperature)
    return GpuSample(
        index=readings.index,
        name=readings.name,
        utilization=None if utilization is None else float(utilization),
        memory_used=_answered(readings.memory_used),
        memory_total=_answered(readings.memory_total),
        power=None if power is None else power / 1000.0,
        power_limit=None if limit is None else limit / 1000.0,
        temperature=None if temperature is None else float(temperature),
    )


def _smi_number(text: str) -> float | None:
    """A value of nvidia-smi's CSV: "[N/A]", "[Not Supported]" and the like are None."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_smi(text: str) -> list[GpuSample]:
    """Pure: ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` as samples
    (memory in MiB there, bytes here; power in watts both)."""
    found = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) < len(SMI_FIELDS) or not cells[0].isdigit():
            continue
        tail = len(SMI_FIELDS) - 2  # a name with commas in it keeps them
        name = ", ".join(cells[1:-tail])
        values = [_smi_number(cell) for cell in cells[-tail:]]
        utilization = values[0]
        if utilization is not None and not 0 <= utilization <= 100:
            utilization = None
        used = values[1]
        total = values[2]
        found.append(
            GpuSample(
                index=int(cells[0]),
                name=name,
                utilization=utilization,
                memory_used=None if used is None else int(used * MIB),
                memory_total=None if total is None else int(total * MIB),
                power=values[3],
                power_limit=values[4],
                temperature=values[5],
            )
        )
    return found[:MAX_GPUS]


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class _MemoryV2(ctypes.Structure):
    """What nvidia-smi reads: ``used`` without the memory the driver reserves."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


NVML_MEMORY_V2 = ctypes.sizeof(_MemoryV2) | (2 << 24)  # nvmlMemory_v2: the struct's version


class NvmlError(Exception):
    """NVML is there but would not answer (no device, a driver/library mismatch)."""


_nvml: ctypes.CDLL | None = None  # loaded and initialised once per agent


def nvml() -> ctypes.CDLL | None:
    """The initialised NVML library; None where the driver's library is not installed."""
    global _nvml
    if _nvml is not None:
        return _nvml
    path = nvml_path()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
    except OSError:
        return None
    code = library.nvmlInit_v2()
    if code == NVML_DRIVER_NOT_LOADED:
        return None  # no GPUs here: not an error
    if code != NVML_SUCCESS:
        raise NvmlError(f"nvmlInit_v2 returned {code}")
    _nvml = library
    return library


def nvml_path() -> str | None:
    """The driver's NVML by absolute path, the first of ``NVML_DIRECTORIES`` that holds one
    ``trusted_program`` trusts (None: none)."""
    for directory in NVML_DIRECTORIES:
        path = os.path.join(directory, NVML_LIBRARY)
        if os.path.exists(path) and trusted_program(path):
            return os.path.realpath(path)
    return None


def _uint_answer(call: object, handle: ctypes.c_void_p, *args: object) -> NvmlAnswer:
    value = ctypes.c_uint(0)
    code = call(handle, *args, ctypes.byref(value))  # type: ignore[operator]
    return NvmlAnswer(int(code), value.value)


@dataclass(frozen=True)
class MemoryAnswers:
    used: NvmlAnswer
    total: NvmlAnswer


def memory_answers(library: ctypes.CDLL, handle: ctypes.c_void_p) -> MemoryAnswers:
    """Memory used and total as nvidia-smi shows them (``GetMemoryInfo_v2``: the driver's
    reservation is not used memory); the first version's, which counts it, on older drivers."""
    with contextlib.suppress(AttributeError):  # a driver from before the second version
        second = _MemoryV2(version=NVML_MEMORY_V2)
        code = int(library.nvmlDeviceGetMemoryInfo_v2(handle, ctypes.byref(second)))
        if code == NVML_SUCCESS:
            return MemoryAnswers(NvmlAnswer(code, second.used), NvmlAnswer(code, second.total))
    first = _Memory()
    code = int(library.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(first)))
    return MemoryAnswers(NvmlAnswer(code, first.used), NvmlAnswer(code, first.total))


def handles(library: ctypes.CDLL) -> list[ctypes.c_void_p]:
    """Every GPU's NVML handle, in index order (at most ``MAX_GPUS``)."""
    count = ctypes.c_uint(0)
    code = library.nvmlDeviceGetCount_v2(ctypes.byref(count))
    if code != NVML_SUCCESS:
        raise NvmlError(f"nvmlDeviceGetCount_v2 returned {code}")
    found = []
    for index in range(min(count.value, MAX_GPUS)):
        handle = ctypes.c_void_p()
        code = library.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle))
        if code != NVML_SUCCESS:
            raise NvmlError(f"nvmlDeviceGetHandleByIndex_v2({index}) returned {code}")
        found.append(handle)
    return found


def read_nvml(library: ctypes.CDLL) -> list[NvmlReadings]:
    """Every GPU's raw answers (per device, each reading)."""
    found = []
    for index, handle in enumerate(handles(library)):
        name = ctypes.create_string_buffer(NAME_BUFFER)
        library.nvmlDeviceGetName(handle, name, ctypes.c_uint(NAME_BUFFER))
        utilization = _Utilization()
        utilization_code = library.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(utilization))
        memory = memory_answers(library, handle)
        found.append(
            NvmlReadings(
                index=index,
                name=name.value.decode(errors="replace"),
                utilization=NvmlAnswer(int(utilization_code), utilization.gpu),
                memory_used=memory.used,
                memory_total=memory.total,
                power=_uint_answer(library.nvmlDeviceGetPowerUsage, handle),
                power_limit=_uint_answer(library.nvmlDeviceGetEnforcedPowerLimit, handle),
                temperature=_uint_answer(
                    library.nvmlDeviceGetTemperature, handle, ctypes.c_int(NVML_TEMPERATURE_GPU)
                ),
            )
        )
    return found


def read_smi() -> list[GpuSample] | None:
    """The GPUs as nvidia-smi reports them; None where there is no nvidia-smi."""
    smi = _on_path("nvidia-smi")
    if smi is None:
        return None
    import subprocess  # only where nvidia-smi is

    query = f"--query-gpu={','.join(SMI_FIELDS)}"
    argv = [smi, query, "--format=csv,noheader,nounits"]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=GPU_PROBE_TIMEOUT, check=False
    )
    if out.returncode != 0:
        raise NvmlError(f"nvidia-smi exited {out.returncode}: {out.stderr.strip()[:200]}")
    return parse_smi(out.stdout)


def read_gpus() -> GpuReadings:
    """NVML first, nvidia-smi where NVML cannot be used, none where neither is installed."""
    why = None
    try:
        library = nvml()
        if library is not None:
            samples = [decode_nvml(readings) for readings in read_nvml(library)]
            return GpuReadings(samples, "nvml")
    except (NvmlError, OSError, AttributeError) as exc:  # AttributeError: a symbol missing
        why = f"NVML: {exc}"
    try:
        smi_samples = read_smi()
    except (NvmlError, OSError, ValueError) as exc:
        return GpuReadings([], "none", f"{why}; {exc}" if why else str(exc))
    except Exception as exc:  # subprocess.TimeoutExpired, without importing subprocess first
        return GpuReadings([], "none", f"nvidia-smi: {exc}")
    if smi_samples is None:
        return GpuReadings([], "none", why)
    return GpuReadings(smi_samples, "nvidia-smi", why)
