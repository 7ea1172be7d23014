"""A hung rank is named, its stacks and every other rank's are written to the run folder, and the attempt
ends so that torchrun restarts it from the newest checkpoint, well before the process group's timeout.

Per rank, a thread writes a heartbeat (``<run_dir>/heartbeat/rank-R.json``: step, seconds into it, the
collectives this rank has entered, where its main thread is) every half second. When one rank's training
step (from its start to the end of its metrics record) has lasted longer than its timeout, it raises the
alarm (``<run_dir>/hang/detected``); every rank's thread then dumps all its Python stacks (faulthandler)
into the hang's folder, the rank that raised it reads every heartbeat and says in one line which rank has
not joined the collective the others wait in, and every rank exits with HANG_EXIT, which torchrun counts
as a failure and restarts.

Which collective: torch's flight recorder (TORCH_FR_BUFFER_SIZE), which gloo and NCCL both keep in
torch 2.13, numbers each group's collectives in the order a rank entered them. The ranks that wait have
entered collective #n and not finished it; the rank they wait for is still at #n-1.

The timeout: ``training.hang_timeout`` when set; else 10 x the slowest of the last 20 steps, at least
60 s and at most half of ``training.timeout_s``. Step times vary (longer sequences, a garbage collection,
another rank's page cache), but rarely tenfold; a hang never ends, so a margin this wide costs a few
minutes of detection against a false alarm that would cost a restart. The floor covers steps of
milliseconds, whose tenfold is shorter than a pause of the machine. The ceiling makes the watchdog fire
before the process-group timeout, which ends the job too but names no one. The first step of each
attempt is not watched: it carries one-off work (compilation, connections, caches) that says nothing
about the steps after it; the process-group timeout bounds it, as it bounds saves and evaluations.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from scalenlp.files import write_file

HANG_EXIT = 75  # sysexits' EX_TEMPFAIL: a temporary failure, worth retrying
FLOOR_S, FACTOR, WINDOW = 60.0, 10.0, 20
INTERVAL_S = 0.5  # between heartbeats
GRACE_S = 10.0  # how long the reporting rank waits for the others' stacks before it names anyone


def record_collectives() -> None:
    """Before the process group exists: keep the last collectives of every group in torch's flight recorder."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")


def hang_timeout(override: float, recent: list[float], pg_timeout_s: float) -> float | None:
    """Seconds a step may last (see the module's docstring); None while there is nothing to derive it from."""
    if override:
        return override
    if not recent:
        return None
    return min(max(FLOOR_S, FACTOR * max(recent)), pg_timeout_s / 2)


def collectives() -> dict[str, dict]:
    """Per process group, the newest collective this rank entered: {"seq", "op", "sizes", "done"}."""
    try:  # a private binding of the flight recorder, the only reader torch offers for it
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(onlyActive=False))
    except (AttributeError, RuntimeError, ValueError):
        return {}
    newest = {}
    for e in trace.get("entries", []):
        if e.get("is_p2p"):
            continue
        group = "/".join(e["process_group"])
        if group not in newest or e["collective_seq_id"] > newest[group]["seq"]:
            newest[group] = {"seq": e["collective_seq_id"], "op": e["profiling_name"], "sizes": e["input_sizes"],
                             "done": bool(e.get("retired"))}
    return newest


def where(thread_id: int) -> str:
    """The innermost scalenlp frame of a thread: which of our calls it is in."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}scalenlp{os.sep}" in path:
            return f"{Path(path).name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "outside scalenlp"


def diagnose(beats: dict[int, dict], world: int, now: float) -> str:
    """One sentence: who the others wait for, in which collective and where."""
    silent = [r for r in range(world) if r not in beats or now - beats[r]["time"] > 10 * INTERVAL_S]
    if silent:
        return f"rank {', '.join(map(str, silent))} gave no heartbeat (its process is frozen, or its host is gone)"
    for group in sorted({g for b in beats.values() for g in b["collectives"]}):
        seqs = {r: b["collectives"].get(group, {"seq": 0})["seq"] for r, b in beats.items()}
        top = max(seqs.values())
        waiting = [r for r in sorted(beats) if seqs[r] == top and not beats[r]["collectives"][group]["done"]]
        behind = [r for r in sorted(beats) if seqs[r] < top]
        if not waiting:
            continue
        c = beats[waiting[0]]["collectives"][group]
        shapes = f" of shapes {c['sizes']}" if any(c["sizes"]) else ""
        what = f"{c['op']} #{top}{shapes} on process group {group}"
        if not behind:
            return f"every rank is inside {what}, none is behind: the transport itself is stuck"
        return (f"rank {', '.join(map(str, behind))} has not joined {what}, which rank "
                f"{', '.join(map(str, waiting))} wait(s) in at {beats[waiting[0]]['where']}; rank {behind[0]} is at "
                f"{beats[behind[0]]['where']}")
    return "no rank is inside a collective: " + "; ".join(f"rank {r} at {b['where']}" for r, b in sorted(beats.items()))


class Watchdog:
    """This rank's heartbeat and hang watch; a context manager around the training loop."""

    def __init__(self, run_dir: Path, rank: int, world: int, override: float, pg_timeout_s: float,
                 enabled: bool):
        self.beats, self.hangs = Path(run_dir) / "heartbeat", Path(run_dir) / "hang"
        self.rank, self.world, self.override, self.pg_timeout_s = rank, world, override, pg_timeout_s
        self.enabled = enabled
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.step, self.started = 0, None  # started: monotonic time the current step began, None between steps
        self._stop = threading.Event()
        self._main = threading.get_ident()
        if enabled and rank == 0:  # an alarm from a previous attempt must not end this one
            (self.hangs / "detected").unlink(missing_ok=True)

    def step_started(self, step: int) -> None:
        self.step, self.started = step, time.monotonic()

    def step_finished(self) -> None:
        self.recent.append(time.monotonic() - self.started)
        self.started = None

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self.beats.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._watch, name="scalenlp-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()

    def _timeout(self) -> float | None:
        # The first step is not watched (see the module's docstring): recent is empty until it ends.
        return hang_timeout(self.override, list(self.recent), self.pg_timeout_s) if self.recent else None

    def _beat(self) -> None:
        started, limit = self.started, self._timeout()
        beat = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "step": self.step,
                "in_step_s": None if started is None else time.monotonic() - started, "timeout_s": limit,
                "collectives": collectives(), "where": where(self._main), "time": time.time()}
        # Every INTERVAL_S, and read only while the job lives: not worth a sync to disk each time.
        write_file(self.beats / f"rank-{self.rank}.json", json.dumps(beat), durable=False)

    def _watch(self) -> None:
        alarm = self.hangs / "detected"
        while not self._stop.wait(INTERVAL_S):
            self._beat()
            started, limit = self.started, self._timeout()
            if started is not None and limit is not None and time.monotonic() - started > limit:
                self._raise_alarm(alarm, limit)
            if alarm.exists():
                self._end_attempt(alarm)

    def _raise_alarm(self, alarm: Path, limit: float) -> None:
        self.hangs.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(alarm, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one rank reports, the first
        except FileExistsError:
            return
        folder = self.hangs / time.strftime("%Y%m%d-%H%M%S")
        folder.mkdir(exist_ok=True)
        with os.fdopen(fd, "w") as f:
            json.dump({"folder": folder.name, "rank": self.rank, "step": self.step, "timeout_s": limit}, f)

    def _end_attempt(self, alarm: Path) -> None:
        """Dump this rank's stacks; the rank that raised the alarm names the culprit; every rank exits."""
        try:
            raised = json.loads(alarm.read_text())
        except ValueError:  # being written: the next heartbeat reads it
            return
        folder = self.hangs / raised["folder"]
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"stacks-rank{self.rank}.txt", "w") as f:
            faulthandler.dump_traceback(f, all_threads=True)
        report = folder / "report.json"
        deadline = time.monotonic() + GRACE_S
        if raised["rank"] == self.rank:
            while time.monotonic() < deadline and len(list(folder.glob("stacks-rank*.txt"))) < self.world:
                time.sleep(INTERVAL_S)
            beats = {}
            for p in self.beats.glob("rank-*.json"):
                beat = json.loads(p.read_text())
                beats[beat["rank"]] = beat
            line = (f"hang: step {raised['step']} of rank {self.rank} exceeded {raised['timeout_s']:.1f} s "
                    f"(training.hang_timeout); {diagnose(beats, self.world, time.time())}. Stacks of every rank: "
                    f"{folder}; ending this attempt (exit {HANG_EXIT}) so torchrun restarts it")
            report.write_text(json.dumps({"message": line, "heartbeats": beats}, indent=1))
            # On a line of its own: rank 0's progress bar may hold the terminal's current line.
            print(f"\nerror: {line}", file=sys.stderr, flush=True)
        else:
            while time.monotonic() < deadline + GRACE_S and not report.exists():
                time.sleep(INTERVAL_S)
        os._exit(HANG_EXIT)
