"""What this machine is: GPU through NVML (when there is a driver), CPU, RAM, cgroup limits."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

MB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    nvml_index: int
    name: str
    uuid: str
    driver: str
    total_mb: int


@dataclass(frozen=True)
class Fingerprint:
    """The machine a profile was measured on; GPU fields are empty on a CPU-only machine."""

    gpu_name: str
    gpu_uuid: str
    gpu_driver: str
    gpu_vram_mb: int
    cpu: str
    cpu_count: int
    ram_mb: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Hardware:
    gpu: Gpu | None  # the GPU the engine will use, None when it runs on the CPU
    cpu: str
    cpu_count: int
    ram_mb: int  # host RAM
    cgroup_max_mb: int | None  # cgroup v2 memory.max, None when unlimited or absent

    @property
    def usable_ram_mb(self) -> int:
        return min(self.ram_mb, self.cgroup_max_mb) if self.cgroup_max_mb else self.ram_mb

    @property
    def fingerprint(self) -> Fingerprint:
        g = self.gpu
        return Fingerprint(gpu_name=g.name if g else "", gpu_uuid=g.uuid if g else "",
                           gpu_driver=g.driver if g else "", gpu_vram_mb=g.total_mb if g else 0,
                           cpu=self.cpu, cpu_count=self.cpu_count, ram_mb=self.ram_mb)


class Nvml:
    """NVML through nvidia-ml-py. ``Nvml.open()`` is None without a driver: CPU-only telemetry."""

    def __init__(self, module: Any) -> None:
        self.nv = module

    @classmethod
    def open(cls) -> "Nvml | None":
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return None
        return cls(pynvml)

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass

    def device_count(self) -> int:
        return self.nv.nvmlDeviceGetCount()

    def handle(self, index: int) -> Any:
        return self.nv.nvmlDeviceGetHandleByIndex(index)

    def gpu(self, index: int) -> Gpu:
        h = self.handle(index)
        return Gpu(nvml_index=index, name=_text(self.nv.nvmlDeviceGetName(h)),
                   uuid=_text(self.nv.nvmlDeviceGetUUID(h)),
                   driver=_text(self.nv.nvmlSystemGetDriverVersion()),
                   total_mb=int(self.nv.nvmlDeviceGetMemoryInfo(h).total // MB))

    def index_of_uuid(self, prefix: str) -> int | None:
        for i in range(self.device_count()):
            if _text(self.nv.nvmlDeviceGetUUID(self.handle(i))).startswith(prefix):
                return i
        return None

    def read(self, index: int, pid: int | None) -> dict[str, float | int | None]:
        """One reading of the GPU; a counter the board does not support reads as None."""
        nv, h = self.nv, self.handle(index)

        def get(fn: Any, *args: Any) -> Any:
            try:
                return fn(h, *args)
            except nv.NVMLError:
                return None

        mem = get(nv.nvmlDeviceGetMemoryInfo)
        used_mb = mem.used / MB if mem is not None else None
        procs = get(nv.nvmlDeviceGetComputeRunningProcesses) or []
        mine = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory]
        power = get(nv.nvmlDeviceGetPowerUsage)
        energy = get(nv.nvmlDeviceGetTotalEnergyConsumption)
        util = get(nv.nvmlDeviceGetUtilizationRates)
        return {
            "gpu_mem_mb": sum(mine) / MB if mine else used_mb,
            "gpu_power_w": power / 1000 if power is not None else None,
            "gpu_energy_j": energy / 1000 if energy is not None else None,
            "gpu_temp_c": get(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            "gpu_sm_clock_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            "gpu_util_pct": util.gpu if util is not None else None,
            "gpu_clock_reasons": get(nv.nvmlDeviceGetCurrentClocksEventReasons),
        }


def detect_hardware(nvml: Nvml | None, device: str, *, torch_cuda: bool) -> Hardware:
    """The machine as the engine will use it. ``device`` is the config's (auto, cpu, cuda[:N]).

    ``torch_cuda`` is torch's answer: a GPU that NVML sees but torch cannot use does not
    count, since the engine would run on the CPU.
    """
    gpu = None
    if device != "cpu" and nvml is not None and torch_cuda:
        cuda_index = int(device.split(":")[1]) if ":" in device else 0
        index = _nvml_index(nvml, cuda_index)
        if index is not None and index < nvml.device_count():
            gpu = nvml.gpu(index)
    cgroup_max, _ = cgroup_memory_mb()
    return Hardware(gpu=gpu, cpu=cpu_name(), cpu_count=psutil.cpu_count(logical=True) or 1,
                    ram_mb=int(psutil.virtual_memory().total // MB), cgroup_max_mb=cgroup_max)


def cuda_available() -> bool:
    """torch's view (imported only when asked): an NVML GPU torch cannot use does not count."""
    import torch

    return torch.cuda.is_available()


def _nvml_index(nvml: Nvml, cuda_index: int) -> int | None:
    """NVML's index of CUDA device ``cuda_index``, following CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_index
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if cuda_index >= len(entries):
        return None
    entry = entries[cuda_index]
    if entry.isdigit():
        return int(entry)
    return nvml.index_of_uuid(entry)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cgroup_memory_mb() -> tuple[int | None, int | None]:
    """(memory.max, memory.current) of this process's cgroup v2 in MB; None where absent."""
    root = Path("/sys/fs/cgroup")
    rel = "/"
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip() or "/"
    except OSError:
        pass
    for folder in (root / rel.lstrip("/"), root):
        limit, current = _read_int(folder / "memory.max"), _read_int(folder / "memory.current")
        if limit is not None or current is not None:
            return (limit // MB if limit else None, current // MB if current is not None else None)
    return None, None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means unlimited


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
