"""What the GPUs reported while a process was captured: utilization and the processes on each device.

A host thread parked in a CUDA synchronization looks the same from its stacks whether the GPU runs a
kernel that never ends or the stream waits on something that will never happen; only the device's own
readings, taken more than once over the capture window, tell the two apart.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvdiag.model.kinds import _Model


class GpuProcessUse(_Model):
    """One process with a context on a GPU (NVML's compute processes)."""

    pid: int                         # as the driver sees it: the host's PID namespace
    used_memory_mb: int | None = None


class GpuDeviceReading(_Model):
    """One GPU at one instant."""

    index: int
    name: str = ""
    uuid: str | None = None
    # NVML's "GPU utilization": the share of the last sample period (1/6 s to 1 s, by product) during
    # which one or more kernels ran. 100 for a kernel that spins forever; 0 for a device with nothing to run.
    utilization_pct: int | None = None
    memory_used_mb: int | None = None
    processes: list[GpuProcessUse] = Field(default_factory=list)
    processes_read: bool = True      # False: the process list could not be read (not "no process")


class GpuSnapshot(_Model):
    """Every GPU at one instant of the capture window."""

    t: float                         # seconds after the first snapshot
    devices: list[GpuDeviceReading] = Field(default_factory=list)


class GpuReadings(_Model):
    """The GPU samples of one capture (the host's, attached to each process captured on it)."""

    source: Literal["pynvml", "nvidia-smi", "none"] = "none"
    snapshots: list[GpuSnapshot] = Field(default_factory=list)
    note: str = ""                   # why nothing (or less than asked) was read: "no GPU", "timed out after 3s"

    @property
    def window_s(self) -> float:
        return self.snapshots[-1].t - self.snapshots[0].t if len(self.snapshots) >= 2 else 0.0

    def device_series(self, index: int) -> list[GpuDeviceReading]:
        """The readings of GPU ``index``, one per snapshot that has it, in order."""
        return [d for s in self.snapshots for d in s.devices if d.index == index]

    def indices(self) -> list[int]:
        return sorted({d.index for s in self.snapshots for d in s.devices})
