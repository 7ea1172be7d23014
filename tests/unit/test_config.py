"""Run configs: TOML files and --set overrides, their one-line errors, and the shipped configs/ that validate."""

from __future__ import annotations

from pathlib import Path

import pytest

from scalenlp.config import ConfigError, load_config, save_config
from scalenlp.train.trainer import validate_run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_config_file_overrides_and_errors(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('[training]\nsteps = 7\nlr = 1\n[model]\nflavor = "small"\n')
    with pytest.raises(ConfigError, match=r"training.lr must be in \(0, 1\)"):
        load_config(file)
    file.write_text('[training]\nsteps = 7\nmixed_precision = "bf16"\n[model]\nflavor = "small"\n')
    cfg = load_config(file, ["training.steps=9", "checkpoint.resume=true", "training.lr=3e-4"])
    assert (cfg.training.steps, cfg.model.flavor, cfg.checkpoint.resume, cfg.training.lr) == (9, "small", True, 3e-4)
    save_config(cfg, tmp_path / "resolved.toml")
    assert load_config(tmp_path / "resolved.toml") == cfg
    for bad, message in [("training.steps=1.5", "expected int"), ("checkpoint.resume=maybe", "true or false"),
                         ("nosuch.key=1", "unknown config key"), ("training.steps", "expected section.key=value"),
                         ("parallel.data_parallel=zero4", "is not one of"), ("training.steps=0", "at least 1")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [bad])
    file.write_text("[lora]\npack_frozen = false\n")  # an option that was a boolean, now auto | onednn | transposed | off
    with pytest.raises(ConfigError, match=r"^lora.pack_frozen: expected a string, got false; put the value in quotes$"):
        load_config(file)
    file.write_text("[training\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(file)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_shipped_configs_load_and_validate(smollm2):
    files = sorted(CONFIGS.glob("*.toml"))
    assert files
    for file in files:
        # The demo fine-tunes the installed SmolLM2, whose path `make demo` passes (read once: conftest's smollm2).
        cfg = load_config(file, [f"model.init={smollm2.path}"] if 'task = "sft"' in file.read_text() else [])
        p = cfg.parallel
        dp_shard = 2 if p.dp_shard == -1 else p.dp_shard  # "the rest of the world": try two data-parallel shards
        validate_run(cfg, p.dp_replicate * dp_shard * p.tp * p.pp, smollm2 if cfg.model.init else None)


def test_keep_best_names_the_tasks_it_applies_to():
    from scalenlp.train.tasks import load_config as task_config

    with pytest.raises(ConfigError, match=r"keep_best applies to the tasks scored by evaluation \(classification, "
                                          r"qa, token_classification\), not training.task='lm'; remove it"):
        task_config(None, ["checkpoint.keep_best=f1"])
