"""[tracking]'s checks: off by default, a URI MLflow cannot open or W&B options without a project end in one
line before anything starts, as does a tracker whose package is missing."""

import sys

import pytest

from scalenlp.config import ConfigError, load_config
from scalenlp.errors import UserError
from scalenlp.train.tracking import check_installed
from train_helpers import error_lines, main_train


def test_both_trackers_are_off_by_default():
    tracking = load_config().tracking
    assert tracking.mlflow_uri == "" and tracking.wandb_project == ""


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example.com", "file:///tmp/mlruns",
                                 "sqlite:///tmp/mlflow.db", "postgresql+psycopg2://u@db/mlflow", "databricks"])
def test_uris_mlflow_opens_are_taken(uri):
    assert load_config(None, [f"tracking.mlflow_uri={uri}"]).tracking.mlflow_uri == uri


@pytest.mark.parametrize("uri", ["ftp://host/x", "localhost:5000", "127.0.0.1", "mlruns", "http//host:5000"])
def test_a_uri_mlflow_cannot_open_is_one_line(uri):
    with pytest.raises(ConfigError, match=r"tracking\.mlflow_uri=.* is not an MLflow tracking URI; give http\(s\)"):
        load_config(None, [f"tracking.mlflow_uri={uri}"])


def test_wandb_options_need_a_project_and_a_known_mode():
    with pytest.raises(ConfigError, match=r"tracking.wandb_mode is set but W&B is off; set tracking.wandb_project"):
        load_config(None, ["tracking.wandb_mode=offline"])
    with pytest.raises(ConfigError, match=r"tracking.wandb_mode='dryrun' is not one of online \| offline"):
        load_config(None, ["tracking.wandb_project=p", "tracking.wandb_mode=dryrun"])


def test_bad_tracking_config_is_one_error_line_from_the_command(tmp_path, capsys):
    assert main_train(tmp_path / "run", "tracking.mlflow_uri=ftp://host/x") == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: tracking.mlflow_uri='ftp://host/x' is not an MLflow tracking URI; give http(s)://HOST:PORT for a "
        "tracking server, file:///PATH for a local folder or a database URI (scheme one of http, https, file, "
        "sqlite, postgresql, mysql, mssql, databricks)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, module", [("tracking.mlflow_uri=http://127.0.0.1:5000", "mlflow"),
                                         ("tracking.wandb_project=p", "wandb")])
def test_a_missing_tracker_package_names_the_extra(monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(UserError, match=rf"needs the {module} package, .* pip install 'scalenlp\[tracking\]'"):
        check_installed(load_config(None, [key]))
