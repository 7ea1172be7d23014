"""[tracking]: a real MLflow tracking server (started here, SQLite store) and W&B in offline mode, read back with
their own client and files; a tracker that does not answer costs one warning line and no record."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from scalenlp.config import config_items, load_config
from scalenlp.parallel.mesh import free_port
from scalenlp.train.tracking import STATE_FILE
from train_helpers import HANG_GUARD_S, TINY, read_metrics, run_train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free port with a SQLite store and artifacts it serves itself; its URI."""
    if importlib.util.find_spec("mlflow.server") is None:
        pytest.skip("needs the mlflow package (the tracking server; the tracking extra's mlflow-skinny has only the "
                    "client): pip install 'scalenlp[test]'")
    folder, port = tmp_path_factory.mktemp("mlflow"), free_port()
    log = open(folder / "server.log", "w")
    # One worker and no job runner: the server's other processes are of no use to these tests.
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "artifacts"),
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG_GUARD_S  # hang guard only
        while True:
            assert server.poll() is None, f"mlflow server exited:\n{(folder / 'server.log').read_text()[-3000:]}"
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=5).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "mlflow server never answered /health"
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its uvicorn worker too
        server.wait()
        log.close()


def tracked_run_id(run_dir: Path, tracker: str) -> str:
    return json.loads((run_dir / STATE_FILE).read_text())[tracker]["run_id"]


def assert_metrics_match(client, run_id: str, records: list[dict]) -> None:
    """Every number of every record is in the MLflow run at its step, once."""
    for key in {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))}:
        logged = [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        assert logged == [(r["step"], pytest.approx(r[key])) for r in records if key in r], key


def test_mlflow_params_metrics_export_and_resume(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    tracking = [f"tracking.mlflow_uri={mlflow_server}", "tracking.mlflow_experiment=tracking-test"]
    run_train(run, *TINY, "training.steps=3", *tracking, nproc=2)  # two ranks: only rank 0 logs
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tracking-test").experiment_id
    (first,) = client.search_runs([experiment])
    run_id = tracked_run_id(run, "mlflow")
    assert first.info.run_id == run_id and first.info.status == "FINISHED"
    config = load_config(run / "config.toml")
    assert first.data.params == {k: str(v) for k, v in config_items(config)}
    assert_metrics_match(client, run_id, read_metrics(run))
    exported = sorted(p.name for p in (run / "export").iterdir())
    assert sorted(Path(a.path).name for a in client.list_artifacts(run_id, "export")) == exported
    got = Path(client.download_artifacts(run_id, "export/model_args.json", str(tmp_path)))
    assert got.read_bytes() == (run / "export" / "model_args.json").read_bytes()

    # Resumed (in one process now): the same MLflow run, the later steps appended to the earlier ones.
    run_train(run, *TINY, "training.steps=5", "checkpoint.resume=true", *tracking)
    (resumed,) = client.search_runs([experiment])
    assert resumed.info.run_id == run_id == tracked_run_id(run, "mlflow") and resumed.info.status == "FINISHED"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert_metrics_match(client, run_id, records)


def wandb_records(wandb_dir: Path) -> list:
    """The records of the one offline run under ``wandb_dir``: its .wandb file is LevelDB's log format (blocks of
    32 KiB, each record in chunks with a 7-byte header: checksum, length, type) after a 7-byte W&B header, each
    record a protobuf Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, chunks, records = path.read_bytes(), 1 << 15, 7, b"", []
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a record's last chunk
            record = Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_a_tracker_that_does_not_answer_costs_one_warning_and_wandb_offline_logs_everything(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the wandb package: pip install 'scalenlp[tracking]'")
    pytest.importorskip("mlflow", reason="needs the mlflow package: pip install 'scalenlp[tracking]'")
    # A server that takes the connection and never answers: each call waits tracking.timeout_s, the first is the last.
    silent = socket.create_server(("127.0.0.1", 0))
    uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # tracking.wandb_mode says offline
    (tmp_path / "wandb").mkdir()
    run = tmp_path / "run"
    with silent:
        proc = run_train(run, *TINY, "training.steps=4", f"tracking.mlflow_uri={uri}", "tracking.timeout_s=2",
                         "tracking.wandb_project=scalenlp-test", "tracking.wandb_mode=offline")
    mentions = [line for line in proc.stderr.splitlines() if "mlflow" in line.lower() or uri in line]
    assert len(mentions) == 1 and mentions[0].startswith(f"warning: MLflow at {uri} stopped taking records"), \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # metrics.jsonl keeps everything

    logged = wandb_records(tmp_path / "wandb")
    (started,) = [r.run for r in logged if r.WhichOneof("record_type") == "run"]
    assert started.run_id == tracked_run_id(run, "wandb") and started.project == "scalenlp-test"
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["training.steps"] == 4 and config["tracking.mlflow_uri"] == uri
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in logged if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"]) for h in history] == [(r["step"], pytest.approx(r["loss"])) for r in records]
    assert [r.artifact.name for r in logged if r.WhichOneof("record_type") == "artifact"] == ["export"]
