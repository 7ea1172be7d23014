"""Experiment trackers ([tracking]: MLflow, Weights & Biases): more sinks of the records metrics.jsonl holds.

Rank 0's MetricsWriter hands each record's numbers to every sink. A tracker works on a thread of its own, so
that a slow or unreachable server never holds up a training step; the first call that fails or does not answer
within tracking.timeout_s drops that tracker for the rest of the run with one warning line, and nothing is
retried. metrics.jsonl, written before any sink, keeps every record either way.

<run_dir>/tracking.json keeps each tracker's run id, so that a resumed run (checkpoint.resume, or a restart by
torchrun) goes on logging to the same MLflow run and the same W&B run."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from scalenlp.config import Config, config_items
from scalenlp.errors import require
from scalenlp.files import write_file

STATE_FILE = "tracking.json"
_END = object()  # closes a tracker's queue


def check_installed(cfg: Config) -> None:
    """One line naming the tracking extra when a tracker is asked for and its package is missing (found without
    importing it: a launcher checks this before starting its processes)."""
    for wanted, module in ((cfg.tracking.mlflow_uri, "mlflow"), (cfg.tracking.wandb_project, "wandb")):
        if wanted and importlib.util.find_spec(module) is None:
            require(module, "tracking")


class _Tracker:
    """One tracker's calls, made in order on a thread of its own. Subclasses give ``start`` (open or reopen the
    run), ``send`` (one record's numbers) and ``finish`` (the export folder, then the run's end)."""

    name = ""

    def __init__(self, where: str, timeout_s: int, log: Callable[[str], None]):
        self.where, self.timeout_s, self.log = where, timeout_s, log
        self.failed = False
        self.uploading = False  # set while the export goes up, which takes as long as its size needs
        self.busy_since: float | None = None  # when the call under way began; None between calls
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name=f"tracker-{self.name}", daemon=True)
        self.thread.start()
        self.queue.put((self.start, ()))

    def log_record(self, step: int, scalars: dict[str, float]) -> None:
        if not self.failed:
            self.queue.put((self.send, (step, scalars)))

    def close(self, export: Path | None) -> None:
        """Send what is queued and end the run, uploading ``export``. The upload may take as long as the export's
        size needs; any other call still under way after tracking.timeout_s is given up."""
        self.queue.put((self.finish, (export,)))
        self.queue.put(_END)
        while self.thread.is_alive():
            self.thread.join(self.timeout_s)
            since = self.busy_since
            if self.thread.is_alive() and since is not None and not self.uploading \
                    and time.monotonic() - since >= self.timeout_s:
                self._drop(f"no answer within tracking.timeout_s={self.timeout_s} s")
                return

    def _work(self) -> None:
        while (item := self.queue.get()) is not _END:
            if self.failed:
                continue
            call, args = item
            self.busy_since = time.monotonic()
            try:
                call(*args)
            except Exception as e:  # whatever the client raises: the tracker is dropped, training goes on
                self._drop(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            finally:
                self.busy_since = None

    def _drop(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            self.log(f"warning: {self.name} at {self.where} stopped taking records ({why[:300]}); training goes on "
                     f"without it and metrics.jsonl keeps every record")

    def start(self) -> None:
        raise NotImplementedError

    def send(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, export: Path | None) -> None:
        raise NotImplementedError


class MlflowTracker(_Tracker):
    name = "MLflow"
    PARAMS_PER_CALL = 100  # the most params one log_batch takes

    def __init__(self, cfg: Config, run_dir: Path, run_id: str | None, log: Callable[[str], None]):
        # The client's defaults retry a request 7 times with backoff, each waiting up to 120 s: minutes lost to a
        # server that is down. One try, bounded by tracking.timeout_s, unless the user chose otherwise.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(cfg.tracking.timeout_s))
        # Imported here, before training: an import on the tracker's thread holds the interpreter through the
        # first steps (seconds of CPU) and skews their timing.
        from mlflow import entities, tracking

        self.entities, self.client_class = entities, tracking.MlflowClient
        self.cfg, self.run_dir, self.run_id = cfg, run_dir, run_id
        super().__init__(cfg.tracking.mlflow_uri, cfg.tracking.timeout_s, log)

    def start(self) -> None:
        self.client = self.client_class(self.cfg.tracking.mlflow_uri)
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = self.cfg.tracking.mlflow_experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=self.run_dir.name,
                                     tags={"scalenlp.run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        remember(self.run_dir, "mlflow", {"uri": self.cfg.tracking.mlflow_uri, "run_id": self.run_id})
        # Params are those the run started with: MLflow refuses a param's value changed later (a resumed run
        # with more training.steps), and the export's config.toml holds the config that finished it.
        params = [self.entities.Param(k, str(v)) for k, v in config_items(self.cfg)]
        for i in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + self.PARAMS_PER_CALL])

    def send(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.entities.Metric(k, float(v), now, step) for k, v in scalars.items()])

    def finish(self, export: Path | None) -> None:
        if export is not None:
            self.uploading = True
            self.client.log_artifacts(self.run_id, str(export), "export")
        self.client.set_terminated(self.run_id)


class WandbTracker(_Tracker):
    name = "W&B"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str, log: Callable[[str], None]):
        import wandb  # before training, as MlflowTracker's client

        self.wandb = wandb
        self.cfg, self.run_dir, self.run_id = cfg, run_dir, run_id
        t = cfg.tracking
        super().__init__(f"project {t.wandb_project} ({t.wandb_mode})", t.timeout_s, log)

    def start(self) -> None:
        t = self.cfg.tracking
        self.run = self.wandb.init(project=t.wandb_project, id=self.run_id, resume="allow", mode=t.wandb_mode,
                              name=self.run_dir.name, dir=os.environ.get("WANDB_DIR", str(self.run_dir)),
                              config=dict(config_items(self.cfg)),
                              settings=self.wandb.Settings(silent=True, console="off", init_timeout=self.timeout_s))

    def send(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self, export: Path | None) -> None:
        self.uploading = True  # finish syncs what is left, the artifact included
        if export is not None:
            artifact = self.wandb.Artifact("export", type="model")
            artifact.add_dir(str(export))
            self.run.log_artifact(artifact)
        self.run.finish()


def remember(run_dir: Path, tracker: str, entry: dict) -> None:
    """Record a tracker's run in <run_dir>/tracking.json (written whole, then renamed)."""
    path = run_dir / STATE_FILE
    state = json.loads(path.read_text()) if path.is_file() else {}
    state[tracker] = entry
    write_file(path, json.dumps(state, indent=1))


def open_trackers(cfg: Config, run_dir: Path, log: Callable[[str], None]) -> list[_Tracker]:
    """The trackers [tracking] asks for, on rank 0, each continuing the run tracking.json names (the MLflow run
    only on the same tracking URI)."""
    t = cfg.tracking
    path = run_dir / STATE_FILE
    state = json.loads(path.read_text()) if path.is_file() else {}
    trackers: list[_Tracker] = []
    if t.wandb_project:
        previous = state.get("wandb", {})
        run_id = previous["run_id"] if previous.get("project") == t.wandb_project else uuid.uuid4().hex[:12]
        # Chosen here, and written before any tracker's thread starts: the MLflow thread writes the file later.
        remember(run_dir, "wandb", {"project": t.wandb_project, "run_id": run_id})
        trackers.append(WandbTracker(cfg, run_dir, run_id, log))
    if t.mlflow_uri:
        previous = state.get("mlflow", {})
        trackers.append(MlflowTracker(cfg, run_dir, previous["run_id"] if previous.get("uri") == t.mlflow_uri
                                      else None, log))
    return trackers
