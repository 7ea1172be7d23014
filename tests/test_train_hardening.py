"""Training never turns good state into bad: damaged or planted checkpoints, non-finite steps, SIGTERM, a full
disk, failed resumes and out-of-range config values each end in a saved state or one clear line."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.checkpoint.filesystem import FileSystem

from scalenlp.config import RANGES, Config, ConfigError, load_config, save_config
from scalenlp.errors import UserError
from scalenlp.models.io import load_pretrained
from scalenlp.train import trainer as trainer_module
from scalenlp.train.tasks import base as task_base
from scalenlp.train.checkpoint import _SafePlanner, load_full_model, read_train_state
from scalenlp.train.trainer import train
from train_helpers import TINY, HANG_GUARD_S, cli_env, error_lines, read_metrics, run_train, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder`` with its modification time and content."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in folder.rglob("*") if p.is_file()}


def in_process(run_dir: Path, corpus: Path, *sets: str):
    return train(load_config(None, [*TINY, f"data.path={corpus}", *sets]), run_dir)


# -- checkpoints: checksums, planted payloads, resumes that fail before writing ---------------------------

def test_a_shard_damaged_in_place_is_named_and_nothing_is_written(tmp_path, corpus):
    run = tmp_path / "run"
    sets = [*TINY, f"data.path={corpus}", "training.steps=2", "checkpoint.every=2"]
    run_train(run, *sets)
    before = snapshot(run)

    wrong_batch = run_train(run, *sets, "training.steps=4", "training.global_batch_size=8", "checkpoint.resume=true",
                            check=False)
    assert wrong_batch.returncode == 2 and "global_batch_size=4" in error_lines(wrong_batch.stderr)[0]
    assert snapshot(run) == before  # config.toml included: every check passes before anything is written

    shard = run / "checkpoints" / "step-2" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # same size, 100 KB of 0xff inside
        f.seek(size // 4)
        f.write(b"\xff" * min(100_000, size // 2))
    damaged = run_train(run, *sets, "training.steps=4", "checkpoint.resume=true", check=False)
    assert damaged.returncode == 2 and "Traceback" not in damaged.stderr
    assert len(error_lines(damaged.stderr)) == 1 and "__0_0.distcp" in error_lines(damaged.stderr)[0]
    assert {k: v for k, v in snapshot(run).items() if "__0_0" not in k} == \
        {k: v for k, v in before.items() if "__0_0" not in k}


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_metadata(folder: Path, payload: bytes) -> None:
    """Replace the checkpoint's index and its checksum, as someone who can write the run folder would."""
    (folder / ".metadata").write_bytes(payload)
    state = json.loads((folder / "train_state.json").read_text())
    state["sha256"][".metadata"] = hashlib.sha256(payload).hexdigest()
    (folder / "train_state.json").write_text(json.dumps(state))


def test_a_planted_checkpoint_index_runs_nothing(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    in_process(run, corpus, "training.steps=2", "checkpoint.export=false")
    folder = run / "checkpoints" / "step-2"
    marker = tmp_path / "ran"

    plant_metadata(folder, pickle.dumps(Payload(marker)))
    with pytest.raises(UserError, match="refusing its .metadata"):
        read_train_state(folder)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(BaseException):  # DCP wraps the refusal; what matters is that nothing ran
        load_full_model(folder, net)
    assert not marker.exists()

    # A module whose import has a side effect: refused by name, never imported.
    (tmp_path / "planted_module.py").write_text(f"open({str(marker)!r}, 'w')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    plant_metadata(folder, b"\x80\x04cplanted_module\nanything\n.")
    with pytest.raises(UserError, match="planted_module.anything is not part of a checkpoint index"):
        read_train_state(folder)
    assert not marker.exists() and "planted_module" not in sys.modules

    # Non-tensor values inside the shards are read with weights_only=True.
    with pytest.raises(pickle.UnpicklingError):
        _SafePlanner().load_bytes(None, io.BytesIO(pickle.dumps(Payload(marker))))
    assert not marker.exists()


# -- non-finite steps ----------------------------------------------------------------------------------

def nan_at(steps: set[int] | None, after: int = 0):
    """lm_loss that answers NaN at the given steps (or every step after ``after``): one call per step."""
    calls = {"n": 0}
    real = task_base.lm_loss

    def patched(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        bad = calls["n"] in steps if steps is not None else calls["n"] > after
        return loss * math.nan if bad else loss
    return patched


def assert_finite_export(run: Path) -> None:
    model = load_pretrained(run / "export")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_step_stops_by_default_and_keeps_the_good_checkpoint(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(task_base, "lm_loss", nan_at({3}))
    with pytest.raises(UserError, match=r"step 3: the loss is not finite on rank 0 .*step-2"):
        in_process(run, corpus, "training.steps=4", "checkpoint.every=2", "checkpoint.keep=1")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert not (run / "export").exists()


def test_nonfinite_step_skip_drops_only_that_update(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(task_base, "lm_loss", nan_at({3}))
    in_process(run, corpus, "training.steps=4", "training.on_nonfinite=skip")
    losses = [r["loss"] for r in read_metrics(run)]
    assert math.isnan(losses[2]) and all(math.isfinite(x) for x in losses[:2] + losses[3:])
    assert_finite_export(run)


def test_nonfinite_step_rollback_reads_on_and_stops_if_it_recurs(tmp_path, corpus, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setattr(task_base, "lm_loss", nan_at({3}))
    in_process(run, corpus, "training.steps=4", "checkpoint.every=2", "training.on_nonfinite=rollback")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # step 3 again, on the next batch
    # Each record's throughput counts its own step's 4 x 32 tokens, not those of the step rolled back.
    assert [r["tokens_per_sec"] * r["step_time_s"] for r in records] == pytest.approx([4 * 32] * 4)
    assert_finite_export(run)

    again = tmp_path / "again"
    monkeypatch.setattr(task_base, "lm_loss", nan_at(None, after=2))
    with pytest.raises(UserError, match="happened again after rolling back to .*step-2"):
        in_process(again, corpus, "training.steps=6", "checkpoint.every=2", "training.on_nonfinite=rollback")
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["step-2"]


# -- a full disk ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True])  # True: the write fails in DCP's writer thread
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, corpus, monkeypatch, async_save):
    """ENOSPC simulated in-process: DCP's file streams for step-4 fail after their first bytes."""
    real = FileSystem.create_stream

    class FullDisk:
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            self.stream.write(bytes(data)[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        with real(self, path, mode) as stream:
            yield FullDisk(stream) if "step-4.tmp" in str(path) and "w" in mode else stream

    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    run = tmp_path / "run"
    with pytest.raises(UserError, match="no space left.*removed the partial step-4.tmp, kept step-2") as e:
        in_process(run, corpus, "training.steps=4", "checkpoint.every=2", f"checkpoint.async_save={async_save}")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    read_train_state(run / "checkpoints" / "step-2")  # whole


def test_an_asynchronous_save_is_logged_as_saved_once_it_is_whole(tmp_path, corpus, monkeypatch):
    lines = []

    def log(self, msg):  # each line with whether the checkpoint it names is whole as it is logged
        if msg.startswith("checkpoint saved: "):
            msg = f"{msg} (whole: {(Path(msg.split(': ', 1)[1]) / 'train_state.json').is_file()})"
        lines.append(msg)

    monkeypatch.setattr(trainer_module.Trainer, "log", log)
    run = tmp_path / "run"
    in_process(run, corpus, "training.steps=4", "checkpoint.every=2", "checkpoint.async_save=true")
    about_saves = [line for line in lines if "checkpoint" in line and "step-" in line]
    assert about_saves == ["saving checkpoint step-2 asynchronously",
                           f"checkpoint saved: {run / 'checkpoints' / 'step-2'} (whole: True)",
                           f"checkpoint saved: {run / 'checkpoints' / 'step-4'} (whole: True)"]  # the last step waits


# -- SIGTERM -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: multi-process, `make test`
def test_sigterm_saves_at_the_next_step_and_exits_0(tmp_path, corpus, nproc):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "scalenlp", "train", "--nproc", str(nproc), "--run-dir", str(run)]
    for s in [*TINY, f"data.path={corpus}", "training.steps=100000", "checkpoint.every=0"]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and not error_lines(stderr)
    stopped = [line for line in stderr.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1, stderr[-3000:]
    last = read_metrics(run)[-1]["step"]
    assert f"after step {last} of 100000" in stopped[0]
    assert read_train_state(run / "checkpoints" / f"step-{last}")["step"] == last
    assert not (run / "export").exists()


# -- config values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, expected", [
    ("training.beta1=nan", "training.beta1 must be a finite number, got nan"),
    ("training.beta2=2", "training.beta2 must be in [0, 1), got 2.0"),
    ("training.min_lr_ratio=-5", "training.min_lr_ratio must be in [0, 1], got -5.0"),
    ("training.eval_batches=0", "training.eval_batches must be at least 1, got 0"),
    ("training.weight_decay=nan", "training.weight_decay must be a finite number"),
    ("training.weight_decay=2000", "training.lr * training.weight_decay must be below 1"),
    ("training.timeout_s=100000000000000000", "training.timeout_s must be in [1,"),
    ("training.seed=-1", "training.seed must be at least 0"),
    ("training.hang_timeout=300", "training.hang_timeout=300 s must be below training.timeout_s=300 s"),
    ("data.path=a\nb", "data.path must not contain control characters"),
    ("training.on_nonfinite=ignore", "training.on_nonfinite='ignore' is not one of stop | skip | rollback"),
])
def test_out_of_range_values_are_one_config_error(setting, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [setting])
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_every_numeric_key_has_its_range():
    numeric = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
               for f in dataclasses.fields(s.default_factory()) if f.type in ("int", "float", int, float)}
    assert numeric == set(RANGES)


KEYS = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(s.default_factory())]
VALUES = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.booleans(), st.text(max_size=20))


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(KEYS), value=VALUES, as_toml=st.booleans())
def test_any_value_is_a_valid_config_or_one_config_error(tmp_path_factory, key, value, as_toml):
    if as_toml:
        section, name = key.split(".")
        literal = json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) \
            else {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(value), repr(value))
        path = tmp_path_factory.mktemp("cfg") / "c.toml"
        path.write_text(f"[{section}]\n{name} = {literal}\n", encoding="utf-8", errors="surrogatepass")
        args = (path, [])
    else:
        args = (None, [f"{key}={value}"])
    try:
        cfg = load_config(*args)
    except ConfigError as e:
        assert "\n" not in str(e)
        return
    out = tmp_path_factory.mktemp("saved") / "config.toml"
    save_config(cfg, out)
    assert load_config(out).to_dict() == cfg.to_dict()  # what a run writes, it reads back


@pytest.mark.parametrize("setting", ["training.beta1=nan", "training.weight_decay=nan", "training.min_lr_ratio=-5",
                                     "model.dropout=inf"])
def test_bad_values_through_the_cli_are_exit_2_with_one_line(tmp_path, setting):
    proc = run_train(tmp_path / "run", setting, check=False)
    assert proc.returncode == 2 and len(error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


# -- plan's bad inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, expected", [
    (["--devices", "1000000000000"], "--devices 1,000,000,000,000 is more than the 131,072 devices plan searches"),
    (["--devices", "8", "--device-spec", "memory_gb=nan"], "--device-spec 'memory_gb=nan': must be a finite number"),
    (["--devices", "8", "--device-spec", "nic_bw=inf"], "--device-spec 'nic_bw=inf': must be a finite number"),
])
def test_plan_refuses_what_it_cannot_answer_in_one_line(capsys, extra, expected):
    from scalenlp.cli import main

    assert main(["plan", "--model", "llama-8b", "--seq", "4096", "--global-batch", "1024", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1
