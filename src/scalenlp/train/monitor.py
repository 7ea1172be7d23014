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

The port listens on 127.0.0.1 unless ``monitor.metrics_host`` says otherwise, and takes an optional bearer key.
The folder is in the shared /tmp, so nothing in it is trusted: it is created private (mode 0700) and refused when
it already exists as another user's or open to others; files are written without following links; a file that is
not a snapshot of a live rank of this run (same launcher, rank below the world size) is skipped, not served.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from scalenlp.auth import authorized, key_of
from scalenlp.config import MonitorConfig
from scalenlp.errors import UserError
from scalenlp.files import write_file
from scalenlp.hardware import resident_bytes

TOKEN_ENV = "SCALENLP_METRICS_TOKEN"
MAX_SNAPSHOT_BYTES = 1 << 16  # a snapshot is a few hundred bytes; a larger file is not one
SNAPSHOT = re.compile(r"rank(\d{1,9})\.json")

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
        # Another thread's running time reaches the process's clock when it is switched out or at a tick, so a
        # window far shorter than a tick can take in time spent before it (a unit test read 236% on 2 cores over
        # a few microseconds, with OpenMP workers busy): no reading is more than the machine's cores.
        return min(100 * (cpu - cpu0) / max(wall - wall0, 1e-9), 100.0 * (os.cpu_count() or 1))


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
    run folder, which may be shared by every machine), one per user and port as one server holds a port, and one
    per torchrun node (GROUP_RANK), for nodes that share a /tmp (network namespaces, containers of one host)."""
    node = os.environ.get("GROUP_RANK", "0")
    return _machine_folder() / f"scalenlp-metrics-{os.getuid()}-{port}-node{node}"


def _machine_folder() -> Path:
    """The login session's XDG_RUNTIME_DIR where it is a private folder of this user's (no one else can create a
    name there first, which in /tmp locks a run out: see ``private_folder``); else the temporary folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    try:
        info = os.stat(runtime) if runtime else None
    except OSError:
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
        return Path(runtime)
    return Path(tempfile.gettempdir())


def private_folder(path: Path) -> Path:
    """``path`` as a folder only this user can enter: created with mode 0700, or, when it exists, checked to be a
    folder (not a link) of this user that no one else may read or write. Anyone can create a name in /tmp first;
    such a folder could hold links that make the ranks overwrite the user's files, or snapshots of ranks that
    do not exist."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise UserError(f"cannot create the metrics folder {path}: {e.strerror}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UserError(f"the metrics folder {path} already exists and is not a private folder of this user (it must "
                        f"be a folder owned by uid {os.getuid()} with mode 0700; found "
                        f"{'a folder' if stat.S_ISDIR(info.st_mode) else 'something else'} of uid {info.st_uid}, "
                        f"mode {stat.S_IMODE(info.st_mode):o}); remove it or choose another --metrics-port")
    return path


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` by a file of ``text`` readable by this user only, whole at once (a scrape never reads half
    a file). Not synced to disk: a snapshot is rewritten every interval and means nothing after the machine stops."""
    write_file(path, text, private=True, durable=False)


def _number(value) -> float | None:
    """A JSON number as a float; None for anything else (strings, booleans, numbers beyond a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


class MachineCollector:
    """Prometheus collector of the snapshots in a folder: one series per live rank of the run started by
    ``launcher`` (the process whose children the ranks of a machine are: torchrun's agent, or the shell of a
    one-process run), with ranks below ``world_size``."""

    def __init__(self, folder: Path, launcher: int, world_size: int):
        self.folder, self.launcher, self.world_size = folder, launcher, world_size

    def _read(self, path: Path) -> dict | None:
        """The snapshot in ``path`` with its figures as floats, or None when it is not one of this run's live
        ranks: unreadable, a link, not a regular file, too large, not JSON of the right shape, another run's."""
        try:
            # O_NONBLOCK: a FIFO opens at once and is then refused as not a regular file, instead of blocking
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # removed meanwhile, or a link
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = f.read(MAX_SNAPSHOT_BYTES + 1)
        try:
            snap = json.loads(data) if len(data) <= MAX_SNAPSHOT_BYTES else None
        except ValueError:  # not UTF-8, not JSON, or an integer too long to read
            return None
        rank = int(SNAPSHOT.fullmatch(path.name)[1])
        if not isinstance(snap, dict) or type(snap.get("rank")) is not int or snap["rank"] != rank \
                or rank >= self.world_size:
            return None
        pid = snap.get("pid")
        if type(pid) is not int or not 0 < pid < 2**31 or snap.get("launcher") != self.launcher or not _alive(pid):
            return None
        found = {"rank": rank}
        for part, names in (("resources", RESOURCES), ("training", TRAINING)):
            given = snap.get(part)
            given = given if isinstance(given, dict) else {}
            found[part] = {key: value for key in names if (value := _number(given.get(key))) is not None}
        return found

    def snapshots(self) -> list[dict]:
        try:
            paths = sorted(p for p in self.folder.iterdir() if SNAPSHOT.fullmatch(p.name))
        except OSError:  # the folder removed under a running job: nothing to serve, not an error page
            return []
        return [snap for path in paths if (snap := self._read(path)) is not None]

    def collect(self):
        snaps = self.snapshots()
        for part, names in (("resources", RESOURCES), ("training", TRAINING)):
            for key, (name, help_text) in names.items():
                family = GaugeMetricFamily(name, help_text, labels=["rank"])
                for snap in snaps:
                    if key in snap[part]:
                        family.add_metric([str(snap["rank"])], snap[part][key])
                yield family


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes every few seconds would flood the training log
        pass


def serve_metrics(registry: CollectorRegistry, host: str, port: int, token: str | None) -> WSGIServer:
    """An HTTP server of ``registry`` on ``host``:``port`` in a daemon thread; with ``token``, every request without
    `Authorization: Bearer TOKEN` gets 401."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if token is not None and not authorized(environ.get("HTTP_AUTHORIZATION", ""), token):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong key; send `Authorization: Bearer KEY`\n"]
        return metrics(environ, start_response)

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (ThreadingMixIn, WSGIServer),
                        {"address_family": family, "daemon_threads": True})
    server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="scalenlp-metrics", daemon=True).start()
    return server


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
        self.folder = private_folder(snapshot_folder(cfg.metrics_port))
        self.path = self.folder / f"rank{rank}.json"
        self.sample_cpu = CpuMeter()  # CPU over each Prometheus sample's period
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            token = key_of(cfg.metrics_token_file, "monitor.metrics_token_file", TOKEN_ENV)
            registry = CollectorRegistry()
            registry.register(MachineCollector(self.folder, os.getppid(), int(os.environ.get("WORLD_SIZE", "1"))))
            try:
                self.server = serve_metrics(registry, cfg.metrics_host, cfg.metrics_port, token)
            except OSError as e:  # socket.gaierror included: an address that does not resolve
                raise UserError(f"monitor.metrics_host={cfg.metrics_host} monitor.metrics_port={cfg.metrics_port}: "
                                f"cannot listen ({e.strerror}); choose a free port with --metrics-port and an "
                                f"address of this machine with --metrics-host") from None
        self.thread = threading.Thread(target=self._sample_every_interval, name="scalenlp-monitor", daemon=True)
        self.thread.start()

    def write_sample(self) -> None:
        """Leave this rank's newest resource sample and training figures for the machine's server."""
        snap = {"rank": self.rank, "pid": os.getpid(), "launcher": os.getppid(),
                "resources": sample(self.sample_cpu, self.device), "training": dict(self.training)}
        write_private(self.path, json.dumps(snap))

    def _sample_every_interval(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.write_sample()
            except OSError:  # a full /tmp loses this sample, not the sampler: the next one may fit
                pass

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
