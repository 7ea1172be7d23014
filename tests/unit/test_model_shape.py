"""One model shape: `model.*` keys over a flavor (or alone) train that shape, and `scalenlp plan --model` reads the
same keys with the same checks, so a bad shape is the same one error line in both."""

from __future__ import annotations

import json

import pytest
import torch

from scalenlp.cli import main
from scalenlp.config import ConfigError, load_config
from scalenlp.models.flavors import FLAVORS, parse_shape, shape_args
from train_helpers import TINY, main_train, read_metrics


def test_model_keys_train_a_custom_shape(tmp_path, corpus):
    torch.set_num_threads(1)
    sets = [*TINY, f"data.path={corpus}", "training.steps=2", "checkpoint.every=0", "model.layers=3",
            "model.hidden=96", "model.heads=6", "model.kv_heads=3", "model.ffn=160"]
    assert main_train(tmp_path / "run", *sets) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    args = json.loads((tmp_path / "run" / "export" / "model_args.json").read_text())
    assert (args["dim"], args["n_layers"], args["n_heads"], args["n_kv_heads"], args["ffn_dim"]) == (96, 3, 6, 3, 160)
    debug = FLAVORS["debug"]  # what the keys leave alone stays the flavor's
    assert (args["norm"], args["position"], args["max_seq_len"]) == (debug.norm, debug.position, debug.max_seq_len)


def test_a_shape_without_a_flavor_is_the_planners_custom_shape():
    cfg = load_config(overrides=["model.flavor=", "model.family=gpt2", "model.hidden=128", "model.layers=2",
                                 "model.heads=4", "model.vocab_size=1000"])
    assert shape_args(cfg.model, 64) == shape_args(parse_shape("family=gpt2,hidden=128,layers=2,heads=4,"
                                                               "vocab_size=1000"), 64)
    args = shape_args(cfg.model, 64)
    assert (args.ffn_dim, args.n_kv_heads, args.max_seq_len, args.tie_embeddings) == (512, 4, 64, True)


@pytest.mark.parametrize("keys, message", [
    (["model.hidden=96", "model.heads=5"], "model dim 96 is not divisible by n_heads 5"),
    (["model.heads=4", "model.kv_heads=3"], "n_heads 4 is not divisible by n_kv_heads 3"),
    (["model.hidden=36"], "RoPE needs an even head dim, got 9"),
    (["model.family=bert"], "family='bert' is not one of llama | gpt2"),
    (["model.flavor=", "model.hidden=64"], "without a flavor it needs layers, heads"),
    (["model.flavor=tiny"], "model.flavor='tiny' is unknown"),
])
def test_a_bad_shape_is_one_line_in_train_and_in_plan(tmp_path, capsys, keys, message):
    code = main_train(tmp_path / "run", *keys)
    train_err = capsys.readouterr().err
    spec = ",".join(k.removeprefix("model.") for k in keys)
    code_plan = main(["plan", "--model", spec if "flavor=" in spec else f"flavor=debug,{spec}", "--seq", "64",
                      "--global-batch", "8", "--devices", "1"])
    plan_err = capsys.readouterr().err
    assert code == code_plan == 2
    assert train_err.count("\n") == 1 and train_err.startswith("error: ") and message in train_err
    assert plan_err == train_err  # one parser, one set of checks, one line
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_plan_spec_keys_are_the_config_keys():
    with pytest.raises(ConfigError, match="'vocab=100' is not key=value with a key among flavor, family, hidden"):
        parse_shape("hidden=64,layers=2,heads=4,vocab=100")
    with pytest.raises(ConfigError, match="model.layers must be at least 0"):
        parse_shape("flavor=debug,layers=-1")
