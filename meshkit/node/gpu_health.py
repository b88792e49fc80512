"""This node's GPUs' health: through NVML (``gpu_readings``' trusted loading of the driver's
library), else through ``nvidia-smi`` (``SMI_HEALTH_QUERY``). Standard library only.

Each reader gathers the driver's answers into ``GpuHealth`` (None: not supported, not
available); ``gpu_findings`` judges them, a pure function the tests feed recorded answers.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

from ..health import Finding, HealthState
from .gpu_readings import MAX_GPUS, NVML_NOT_AVAILABLE, NVML_SUCCESS, NvmlError, handles, nvml
from .gpus import GPU_PROBE_TIMEOUT, _on_path

SMI_HEALTH_QUERY = (
    "nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,"
    "remapped_rows.pending,remapped_rows.failure,retired_pages.pending,"
    "pcie.link.width.current,pcie.link.width.max,pcie.link.gen.current,pcie.link.gen.max,"
    "clocks_throttle_reasons.hw_slowdown,clocks_throttle_reasons.hw_thermal_slowdown,"
    "clocks_throttle_reasons.sw_thermal_slowdown,utilization.gpu "
    "--format=csv,noheader,nounits"
)
SMI_COLUMNS = 14

# nvmlDeviceGetCurrentClocksThrottleReasons' bits health reads
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_ULL_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
PCI_BUS_ID = 32  # NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
BUSY = 50.0  # percent: below it an idle link may run at a lower generation to save power


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health readings (None: the driver did not say)."""

    index: int
    bus_id: str = ""
    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pending: bool | None = None
    width: int | None = None
    width_max: int | None = None
    generation: int | None = None
    generation_max: int | None = None
    hw_slowdown: bool | None = None
    hw_thermal: bool | None = None
    sw_thermal: bool | None = None
    power_brake: bool | None = None
    utilization: float | None = None


@dataclass(frozen=True)
class GpuHealthRead:
    """The GPUs read, and how ("nvml", "nvidia-smi"; "" when there is no driver here)."""

    gpus: list[GpuHealth]
    via: str


def _name(gpu: GpuHealth) -> str:
    if gpu.bus_id:
        return f"GPU {gpu.index} ({gpu.bus_id})"
    return f"GPU {gpu.index}"


def gpu_findings(gpus: list[GpuHealth], expected: int | None) -> list[Finding]:
    """Pure: what ``gpus`` say of the node, ``expected`` the GPUs it must have (None: any)."""
    found: list[Finding] = []

    def add(state: HealthState, code: str, what: str) -> None:
        found.append(Finding("gpu", state, code, what))

    if expected is not None and len(gpus) < expected:
        add(HealthState.UNHEALTHY, "gpus:missing", f"{len(gpus)} GPUs of {expected} expected")
    for gpu in gpus:
        name = _name(gpu)
        if gpu.ecc_uncorrected:
            what = f"{name}: {gpu.ecc_uncorrected} uncorrected ECC errors"
            add(HealthState.UNHEALTHY, "ecc:uncorrected", what)
        if gpu.remap_failure:
            add(HealthState.UNHEALTHY, "remap:failure", f"{name}: a row remapping failed")
        elif gpu.remap_pending:
            add(HealthState.DEGRADED, "remap:pending", f"{name}: row remapping pending (reset)")
        if gpu.retired_pending:
            add(HealthState.DEGRADED, "retired:pending", f"{name}: page retirement pending")
        if gpu.width is not None and gpu.width_max is not None and gpu.width < gpu.width_max:
            what = f"{name}: PCIe link x{gpu.width} of x{gpu.width_max}"
            add(HealthState.DEGRADED, "pcie:width", what)
        busy = gpu.utilization is not None and gpu.utilization >= BUSY
        low_generation = (
            gpu.generation is not None
            and gpu.generation_max is not None
            and gpu.generation < gpu.generation_max
        )
        if busy and low_generation:
            what = f"{name}: PCIe gen {gpu.generation} of {gpu.generation_max} while busy"
            add(HealthState.DEGRADED, "pcie:gen", what)
        if gpu.hw_thermal or gpu.sw_thermal:
            add(HealthState.DEGRADED, "throttle:thermal", f"{name}: thermal slowdown")
        if gpu.hw_slowdown:
            add(HealthState.DEGRADED, "throttle:hw_slowdown", f"{name}: hardware slowdown")
        if gpu.power_brake:
            add(HealthState.DEGRADED, "throttle:power_brake", f"{name}: power brake slowdown")
    return found


# ---- nvidia-smi


def _smi_int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def _smi_flag(text: str) -> bool | None:
    """ "Yes"/"Active" True, "No"/"Not Active" False, else (not supported) None; a number is
    a count (remapped_rows.failure may be one)."""
    lowered = text.lower()
    if lowered in ("yes", "active"):
        return True
    if lowered in ("no", "not active"):
        return False
    number = _smi_int(text)
    if number is None:
        return None
    return number > 0


def parse_smi_health(text: str) -> list[GpuHealth]:
    """Pure: ``SMI_HEALTH_QUERY``'s answer as readings (a line of another shape is skipped)."""
    found = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != SMI_COLUMNS or not cells[0].isdigit():
            continue
        utilization = _smi_int(cells[13])
        found.append(
            GpuHealth(
                index=int(cells[0]),
                bus_id=cells[1][:40],
                ecc_uncorrected=_smi_int(cells[2]),
                remap_pending=_smi_flag(cells[3]),
                remap_failure=_smi_flag(cells[4]),
                retired_pending=_smi_flag(cells[5]),
                width=_smi_int(cells[6]),
                width_max=_smi_int(cells[7]),
                generation=_smi_int(cells[8]),
                generation_max=_smi_int(cells[9]),
                hw_slowdown=_smi_flag(cells[10]),
                hw_thermal=_smi_flag(cells[11]),
                sw_thermal=_smi_flag(cells[12]),
                utilization=None if utilization is None else float(utilization),
            )
        )
    return found[:MAX_GPUS]


def read_smi_health(program: str | None = None) -> list[GpuHealth] | None:
    """The GPUs' health as nvidia-smi reports it; None where there is no (trusted) nvidia-smi."""
    smi = program or _on_path("nvidia-smi")
    if smi is None:
        return None
    import subprocess  # only where nvidia-smi is

    argv = [smi, *SMI_HEALTH_QUERY.split()[1:]]
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=GPU_PROBE_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NvmlError(f"nvidia-smi did not answer in {GPU_PROBE_TIMEOUT:.0f}s") from exc
    if out.returncode != 0:
        raise NvmlError(f"nvidia-smi exited {out.returncode}: {out.stderr.strip()[:200]}")
    return parse_smi_health(out.stdout[: 1 << 20])


# ---- NVML


@dataclass(frozen=True)
class NvmlHealthAnswers:
    """NVML's raw answers for one GPU: each call's return code and what it wrote."""

    index: int
    bus_id: str
    ecc: tuple[int, int]
    remapped: tuple[int, int, int]  # code, pending, failure
    retired: tuple[int, int]
    width: tuple[int, int]
    width_max: tuple[int, int]
    generation: tuple[int, int]
    generation_max: tuple[int, int]
    throttle: tuple[int, int]
    utilization: tuple[int, int]


def _value(answer: tuple[int, int], missing: int = NVML_NOT_AVAILABLE) -> int | None:
    code, value = answer
    if code != NVML_SUCCESS or value == missing:
        return None
    return value


def decode_nvml_health(answers: NvmlHealthAnswers) -> GpuHealth:
    """Pure: NVML's raw answers as readings (a call that failed, NOT_SUPPORTED say, is None)."""
    remap_pending = None
    remap_failure = None
    if answers.remapped[0] == NVML_SUCCESS:
        remap_pending = answers.remapped[1] != 0
        remap_failure = answers.remapped[2] != 0
    retired = _value(answers.retired)
    throttle = _value(answers.throttle, NVML_ULL_NOT_AVAILABLE)
    utilization = _value(answers.utilization)

    def bit(mask: int) -> bool | None:
        return None if throttle is None else bool(throttle & mask)

    return GpuHealth(
        index=answers.index,
        bus_id=answers.bus_id,
        ecc_uncorrected=_value(answers.ecc, NVML_ULL_NOT_AVAILABLE),
        remap_pending=remap_pending,
        remap_failure=remap_failure,
        retired_pending=None if retired is None else retired != 0,
        width=_value(answers.width),
        width_max=_value(answers.width_max),
        generation=_value(answers.generation),
        generation_max=_value(answers.generation_max),
        hw_slowdown=bit(HW_SLOWDOWN),
        hw_thermal=bit(HW_THERMAL),
        sw_thermal=bit(SW_THERMAL),
        power_brake=bit(HW_POWER_BRAKE),
        utilization=None if utilization is None or utilization > 100 else float(utilization),
    )


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


def _uint(call: object, handle: ctypes.c_void_p) -> tuple[int, int]:
    value = ctypes.c_uint(0)
    code = call(handle, ctypes.byref(value))  # type: ignore[operator]
    return int(code), value.value


class _PciInfo(ctypes.Structure):
    """nvmlPciInfo_t (what nvmlDeviceGetPciInfo_v3 writes)."""

    _fields_ = [
        ("bus_id_legacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pci_device_id", ctypes.c_uint),
        ("pci_subsystem_id", ctypes.c_uint),
        ("bus_id", ctypes.c_char * PCI_BUS_ID),
    ]


def _bus_id(library: ctypes.CDLL, handle: ctypes.c_void_p) -> str:
    """The GPU's PCI bus id ("00000000:3B:00.0"; "" where the driver will not say)."""
    info = _PciInfo()
    with contextlib.suppress(AttributeError):  # a driver from before the call
        if library.nvmlDeviceGetPciInfo_v3(handle, ctypes.byref(info)) == NVML_SUCCESS:
            bus_id: bytes = info.bus_id
            return bus_id.decode(errors="replace")[:40]
    return ""


def read_nvml_health(library: ctypes.CDLL) -> list[NvmlHealthAnswers]:
    """Every GPU's raw health answers."""
    found = []
    for index, handle in enumerate(handles(library)):
        ecc = ctypes.c_ulonglong(0)
        ecc_code = library.nvmlDeviceGetTotalEccErrors(
            handle,
            ctypes.c_int(NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            ctypes.c_int(NVML_VOLATILE_ECC),
            ctypes.byref(ecc),
        )
        corrected = ctypes.c_uint(0)
        uncorrected = ctypes.c_uint(0)
        pending = ctypes.c_uint(0)
        failure = ctypes.c_uint(0)
        remap_code = library.nvmlDeviceGetRemappedRows(
            handle,
            ctypes.byref(corrected),
            ctypes.byref(uncorrected),
            ctypes.byref(pending),
            ctypes.byref(failure),
        )
        throttle = ctypes.c_ulonglong(0)
        throttle_code = library.nvmlDeviceGetCurrentClocksThrottleReasons(
            handle, ctypes.byref(throttle)
        )
        utilization = _Utilization()
        utilization_code = library.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(utilization))
        found.append(
            NvmlHealthAnswers(
                index=index,
                bus_id=_bus_id(library, handle),
                ecc=(int(ecc_code), ecc.value),
                remapped=(int(remap_code), pending.value, failure.value),
                retired=_uint(library.nvmlDeviceGetRetiredPagesPendingStatus, handle),
                width=_uint(library.nvmlDeviceGetCurrPcieLinkWidth, handle),
                width_max=_uint(library.nvmlDeviceGetMaxPcieLinkWidth, handle),
                generation=_uint(library.nvmlDeviceGetCurrPcieLinkGeneration, handle),
                generation_max=_uint(library.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                throttle=(int(throttle_code), throttle.value),
                utilization=(int(utilization_code), utilization.gpu),
            )
        )
    return found


def read_gpu_health() -> GpuHealthRead:
    """NVML first, nvidia-smi where NVML cannot be used; ``via`` "" where neither is here.
    Raises ``NvmlError`` (with both readers' why) where a driver is but cannot be read."""
    why = None
    try:
        library = nvml()
        if library is not None:
            answers = read_nvml_health(library)
            return GpuHealthRead([decode_nvml_health(gpu) for gpu in answers], "nvml")
    except (NvmlError, OSError, AttributeError) as exc:  # AttributeError: a symbol missing
        why = f"NVML: {exc}"
    try:
        gpus = read_smi_health()
    except (NvmlError, OSError) as exc:
        raise NvmlError(f"{why}; {exc}" if why else str(exc)) from exc
    if gpus is None:
        if why is not None:
            raise NvmlError(why)
        return GpuHealthRead([], "")
    return GpuHealthRead(gpus, "nvidia-smi")
