"""What every rank uses while it trains: CPU, resident memory, and on a GPU device memory and utilisation.

Two readers. metrics.jsonl (and so TensorBoard): at each metrics record the ranks all-gather a sample
taken over the record's window, and rank 0 writes it as ``cpu_percent/rank0``, ``rss_bytes/rank1``, ...
Prometheus (``monitor.metrics_port``, ``scalenlp train --metrics-port P``): each rank's sampler thread
writes its newest sample and training figures (step, loss, tokens/s of the last record) every
``monitor.interval_s`` to a small file in a folder of this machine, and local rank 0 serves all of them on
port P of the machine, labelled ``rank="N"``. One port per machine rather than P + local rank, so that a
pod has a single scrape target (the ``prometheus.io/port`` annotation takes one). Files rather than
prometheus_client's multiprocess mode: that mode is chosen by an environment variable before the first
import of prometheus_client, and its files outlive crashed ranks; here a rank's series is served only
while its process lives, so a dead rank disappears instead of showing its last values forever.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from scalenlp.config import MonitorConfig
from scalenlp.errors import UserError
from scalenlp.hardware import resident_bytes

# Sample keys (as in metrics.jsonl) -> (Prometheus name, help). The GPU keys are absent on a CPU run.
RESOURCES = {
    "cpu_percent": ("scalenlp_train_cpu_percent", "CPU time of the rank's process (all threads) over the last "
                                                  "sample period, in percent of one core"),
    "rss_bytes": ("scalenlp_train_resident_memory_bytes", "resident set size of the rank's process"),
    "gpu_mem_allocated_bytes": ("scalenlp_train_gpu_memory_allocated_bytes",
                                "GPU memory held by the rank's tensors (torch.cuda.memory_allocated)"),
    "gpu_mem_reserved_bytes": ("scalenlp_train_gpu_memory_reserved_bytes",
                               "GPU memory reserved by the rank's caching allocator (torch.cuda.memory_reserved)"),
    "gpu_util_percent": ("scalenlp_train_gpu_utilization_percent",
                         "percent of the last NVML sample period in which the rank's GPU ran a kernel"),
}
TRAINING = {
    "step": ("scalenlp_train_step", "optimizer steps done, as of the newest metrics record"),
    "loss": ("scalenlp_train_loss", "training loss of the newest metrics record"),
    "tokens_per_sec": ("scalenlp_train_tokens_per_second", "tokens per second over the newest metrics record's "
                                                           "window, all data-parallel ranks together"),
}


class CpuMeter:
    """This process's CPU use since the previous reading, in percent of one core."""

    def __init__(self):
        self.last = self._now()

    @staticmethod
    def _now() -> tuple[float, float]:
        # User and system time of every thread of the process, read to the nanosecond: os.times() counts
        # 10 ms ticks, which over a short record window reads far above 100% per core.
        return time.process_time(), time.monotonic()

    def percent(self) -> float:
        (cpu0, wall0), (cpu, wall) = self.last, self._now()
        self.last = (cpu, wall)
        return 100 * (cpu - cpu0) / max(wall - wall0, 1e-9)


def gpu_utilization(device: torch.device) -> float | None:
    """NVML's utilisation of ``device``; None without NVML. torch.cuda.utilization imports pynvml, which
    the optional nvidia-ml-py package provides: a GPU run without it still reports memory."""
    try:
        return float(torch.cuda.utilization(device))
    except (ModuleNotFoundError, RuntimeError):
        return None


def sample(cpu: CpuMeter, device: torch.device) -> dict[str, float]:
    """One reading of this rank's resources (CPU since ``cpu``'s previous reading)."""
    reading = {"cpu_percent": cpu.percent(), "rss_bytes": float(resident_bytes(peak=False))}
    if device.type == "cuda":
        reading["gpu_mem_allocated_bytes"] = float(torch.cuda.memory_allocated(device))
        reading["gpu_mem_reserved_bytes"] = float(torch.cuda.memory_reserved(device))
        util = gpu_utilization(device)
        if util is not None:
            reading["gpu_util_percent"] = util
    return reading


def snapshot_folder(port: int) -> Path:
    """Where the ranks of this machine that serve on ``port`` leave their samples: machine-local (not the
    run folder, which may be shared by every machine), one per port as one server holds a port, and one per
    torchrun node (GROUP_RANK), for nodes that share a /tmp (network namespaces, containers of one host)."""
    return Path(tempfile.gettempdir()) / f"scalenlp-metrics-{port}-node{os.environ.get('GROUP_RANK', '0')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


class MachineCollector:
    """Prometheus collector of the samples in a snapshot folder, one series per live rank."""

    def __init__(self, folder: Path):
        self.folder = folder

    def snapshots(self) -> list[dict]:
        found = []
        for path in sorted(self.folder.glob("rank*.json")):
            try:
                snap = json.loads(path.read_text())
            except (OSError, ValueError):  # removed or replaced while read: the next scrape has it
                continue
            if _alive(snap["pid"]):
                found.append(snap)
        return found

    def collect(self):
        snaps = self.snapshots()
        for part, names in (("resources", RESOURCES), ("training", TRAINING)):
            for key, (name, help_text) in names.items():
                family = GaugeMetricFamily(name, help_text, labels=["rank"])
                for snap in snaps:
                    if key in snap[part]:
                        family.add_metric([str(snap["rank"])], snap[part][key])
                yield family


class Monitor:
    """This rank's sampler; on local rank 0 with a metrics port, also the machine's HTTP server."""

    def __init__(self, cfg: MonitorConfig, device: torch.device, rank: int):
        self.device, self.rank, self.interval_s = device, rank, cfg.interval_s
        self.record_cpu = CpuMeter()  # CPU over each metrics record's window
        self.training: dict[str, float] = {}
        self.server = self.thread = None
        self.stopped = threading.Event()
        if not cfg.metrics_port:
            return
        self.folder = snapshot_folder(cfg.metrics_port)
        self.folder.mkdir(exist_ok=True)
        self.path = self.folder / f"rank{rank}.json"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            registry = CollectorRegistry()
            registry.register(MachineCollector(self.folder))
            try:
                self.server, _ = start_http_server(cfg.metrics_port, addr="0.0.0.0", registry=registry)
            except OSError as e:
                raise UserError(f"monitor.metrics_port={cfg.metrics_port}: cannot listen ({e.strerror}); choose a "
                                f"free port with --metrics-port") from None
        self.thread = threading.Thread(target=self._sample_every_interval, name="scalenlp-monitor", daemon=True)
        self.thread.start()

    def _sample_every_interval(self) -> None:
        cpu = CpuMeter()
        while not self.stopped.wait(self.interval_s):
            snap = {"rank": self.rank, "pid": os.getpid(), "resources": sample(cpu, self.device),
                    "training": dict(self.training)}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(snap))
            os.replace(tmp, self.path)  # a scrape never reads half a file

    def gather(self) -> dict[str, float]:
        """Every rank's resources over the window since the previous call, keyed ``<resource>/rank<N>``.
        A collective: every rank calls it at the same step."""
        mine = sample(self.record_cpu, self.device)
        values = torch.tensor([mine.get(key, math.nan) for key in RESOURCES], dtype=torch.float64)
        rows = [values]
        if dist.is_initialized():  # CPU tensors: gloo, also beside NCCL (the cpu:gloo backend)
            rows = [torch.empty_like(values) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, values)
        return {f"{key}/rank{rank}": value for rank, row in enumerate(rows)
                for key, value in zip(RESOURCES, row.tolist()) if not math.isnan(value)}

    def publish(self, record: dict) -> None:
        """Hand the training figures of a metrics record to the next Prometheus sample."""
        self.training = {key: float(record[key]) for key in TRAINING}

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
            self.path.unlink(missing_ok=True)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
