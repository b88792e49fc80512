"""A ``top`` snapshot in Prometheus' text exposition format (``top --format prometheus``), for
node_exporter's textfile collector or a scrape, named as node_exporter and NVIDIA's DCGM exporter
name the same figures, and labelled by node (as the hostfile spells it) and node rank; a rank's
figures also by rank. Nothing listens: the text is printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .top import Snapshot

MIB = 1 << 20


@dataclass
class Family:
    """One metric: its help, its type and its samples (labels, value)."""

    name: str
    help: str
    kind: str = "gauge"
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def render(families: list[Family]) -> str:
    lines = []
    for family in families:
        if not family.samples:
            continue
        lines.append(f"# HELP {family.name} {family.help}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for labels, value in family.samples:
            pairs = ",".join(f'{key}="{_escaped(text)}"' for key, text in labels.items())
            lines.append(f"{family.name}{{{pairs}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def prometheus(snapshot: Snapshot) -> str:
    """The snapshot's figures as Prometheus metrics (a figure a node did not report is left out;
    a node that is down has ``meshkit_node_up`` 0 and nothing else)."""
    up = Family("meshkit_node_up", "1 if the node answered this snapshot, else 0")
    cpu = Family("node_cpu_busy_percent", "Percent of all cores busy since the previous sample")
    load1 = Family("node_load1", "1m load average")
    load5 = Family("node_load5", "5m load average")
    load15 = Family("node_load15", "15m load average")
    mem_total = Family("node_memory_MemTotal_bytes", "Memory information field MemTotal_bytes")
    mem_available = Family(
        "node_memory_MemAvailable_bytes", "Memory information field MemAvailable_bytes"
    )
    receive_total = Family(
        "node_network_receive_bytes_total", "Network device statistic receive_bytes", "counter"
    )
    transmit_total = Family(
        "node_network_transmit_bytes_total", "Network device statistic transmit_bytes", "counter"
    )
    receive_rate = Family("node_network_receive_bytes_per_second", "Bytes/s received lately")
    transmit_rate = Family("node_network_transmit_bytes_per_second", "Bytes/s sent lately")
    gpu_util = Family("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)")
    fb_used = Family("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)")
    fb_free = Family("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)")
    power = Family("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)")
    power_limit = Family("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "Enforced power limit (in W)")
    temperature = Family("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)")
    rank_cpu = Family("meshkit_rank_cpu_percent", "Percent of one core the rank used lately")
    rank_rss = Family("meshkit_rank_resident_memory_bytes", "The rank's resident memory")
    step = Family("meshkit_rank_step", "The steps the rank told (meshkit.progress) this attempt")
    steps_rate = Family("meshkit_rank_steps_per_second", "The rank's steps/s over the window")
    step_age = Family("meshkit_rank_step_age_seconds", "Seconds since the rank's last step")
    idle = Family("meshkit_job_idle_seconds", "Seconds since the job's log on the node was written")
    odd = Family("meshkit_odd_one_out", "1 for each node, GPU or rank far from its peers")
    for view in snapshot.nodes:
        node = {"node": view.node, "node_rank": str(view.node_rank)}
        up.samples.append((node, 1.0 if view.up else 0.0))
        sample = view.sample
        if sample is None:
            continue
        if sample.cpu is not None:
            cpu.samples.append((node, sample.cpu))
        for family, value in zip((load1, load5, load15), sample.load):
            family.samples.append((node, value))
        mem_total.samples.append((node, sample.memory_total))
        mem_available.samples.append((node, sample.memory_total - sample.memory_used))
        for port in sample.ports:
            device = {**node, "device": port.name}
            receive_total.samples.append((device, port.received))
            transmit_total.samples.append((device, port.sent))
            if port.receive_rate is not None:
                receive_rate.samples.append((device, port.receive_rate))
            if port.send_rate is not None:
                transmit_rate.samples.append((device, port.send_rate))
        for gpu in sample.gpus:
            labels = {**node, "gpu": str(gpu.index), "modelName": gpu.name}
            if gpu.utilization is not None:
                gpu_util.samples.append((labels, gpu.utilization))
            if gpu.memory_used is not None:
                fb_used.samples.append((labels, gpu.memory_used // MIB))
                if gpu.memory_total is not None:
                    free = (gpu.memory_total - gpu.memory_used) // MIB
                    fb_free.samples.append((labels, free))
            if gpu.power is not None:
                power.samples.append((labels, gpu.power))
            if gpu.power_limit is not None:
                power_limit.samples.append((labels, gpu.power_limit))
            if gpu.temperature is not None:
                temperature.samples.append((labels, gpu.temperature))
        for rank in sample.ranks:
            labels = {**node, "rank": str(rank.rank), "pid": str(rank.pid)}
            if rank.cpu is not None:
                rank_cpu.samples.append((labels, rank.cpu))
            rank_rss.samples.append((labels, rank.rss))
        for told in sample.progress:
            labels = {**node, "rank": str(told.rank)}
            step.samples.append((labels, told.step))
            if told.rate is not None:
                steps_rate.samples.append((labels, told.rate))
            step_age.samples.append((labels, told.age))
        if sample.idle is not None:
            idle.samples.append((node, sample.idle))
    for each in snapshot.odd:
        labels = {"node": each.node, "kind": each.kind, "what": each.what}
        odd.samples.append((labels, 1.0))
    families = [up, cpu, load1, load5, load15, mem_total, mem_available]
    families += [receive_total, transmit_total, receive_rate, transmit_rate]
    families += [gpu_util, fb_used, fb_free, power, power_limit, temperature]
    families += [rank_cpu, rank_rss, step, steps_rate, step_age, idle, odd]
    return render(families)
