"""Out-of-range values are one clear line: each config key's range (in TOML or --set, checked in this process and
through the CLI's main), any value at all either a valid config that reads back as written or one ConfigError,
and plan's flags it cannot answer."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scalenlp.config import RANGES, Config, ConfigError, load_config, save_config
from train_helpers import error_lines, main_train


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
def test_bad_values_through_the_cli_are_exit_2_with_one_line(tmp_path, capsys, setting):
    assert main_train(tmp_path / "run", setting) == 2
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and err.count("\n") == 1, err
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
