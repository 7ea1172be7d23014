"""Hugging Face decoder families (models/families): a model transformers builds from a small random config of each
gives the same logits through scalenlp's loader, the same greedy tokens through the engine (windows and all, in
the KV cache), and exports back to the same class with the same logits."""

import json
import threading

import pytest
import torch

from scalenlp.cli import main
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.sampling import SamplingParams
from scalenlp.errors import UserError
from scalenlp.loader import load
from scalenlp.models.hf import args_from_hf
from train_helpers import HF_DECODERS, make_hf_decoder

torch.set_num_threads(1)
pytestmark = pytest.mark.usefixtures("transformers")


@pytest.fixture(scope="module", params=list(HF_DECODERS))
def family(request, tmp_path_factory, corpus):
    """(model_type, folder saved by transformers, the transformers model), once per family."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_hf_decoder(folder, request.param, corpus)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def test_same_logits_as_transformers(family):
    model_type, folder, hf = family
    model, pre = load(folder)
    assert pre.args.hf_type == model_type
    tokens = torch.randint(0, pre.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert relative_error(model(tokens), hf(tokens).logits) < 1e-4


def greedy_engine(model, tokenizer, prompts: list[list[int]], n: int, **options) -> list[list[int]]:
    """Each prompt's ``n`` greedy tokens, all prompts in one continuous batch (an Engine with ``options``)."""
    engine = Engine(model, tokenizer, max_batch=len(prompts), **options).start()
    try:
        done = [threading.Event() for _ in prompts]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        requests = engine.submit_many([(p, params) for p in prompts],
                                      [lambda d, e=e: d.finish_reason is not None and e.set() for e in done])
        for event in done:
            event.wait()
        return [r.output_ids for r in requests]
    finally:
        engine.stop()


def test_same_greedy_tokens_through_the_engine(family):
    """Prompts of 3 and 7 tokens and 12 new ones each: past every window of 4, so the cache's mask decides."""
    _, folder, hf = family
    model, pre = load(folder)
    prompts = [[5, 17, 42], [8, 3, 99, 150, 7, 61, 2]]
    ours = greedy_engine(model, pre.tokenizer, prompts, 12)
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert all(len(set(t)) > 2 for t in theirs)  # not one token repeated, which any model near it would give too
    assert ours == theirs


def test_a_window_model_serves_sequences_longer_than_its_cache(tmp_path, corpus):
    """Mistral with a window of 4 on every layer: a request gives back the KV blocks wholly before its window, so
    sequences of 27 and 31 positions run together in a cache of 12 (3 blocks of 4: the limit was 12 positions a
    request) with transformers' greedy tokens. Each holds 2 blocks past a step; they contend for the third, so the
    newer one is preempted (6 times here) and computed again chunk by chunk, taking blocks as its window moves on.
    Giving back one position too early changes the tokens."""
    hf = make_hf_decoder(tmp_path, "mistral", corpus)
    model, pre = load(tmp_path)
    prompts = [[5, 17, 42], [8, 3, 99, 150, 7, 61, 2]]
    n = 24
    ours = greedy_engine(model, pre.tokenizer, prompts, n, kv_cache_tokens=12, block_size=4)
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert all(len(set(t)) > 2 for t in theirs)
    assert ours == theirs


def test_export_loads_back_in_the_same_class(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model_type, folder, hf = family
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(folder), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(back(tokens).logits, hf(tokens).logits) < 1e-4


def test_options_read_from_each_config(family):
    """What the adapters make of the configs: the window only on the layers layer_types names, Gemma 3's linear
    RoPE scaling."""
    model_type, _, hf = family
    args = args_from_hf(hf.config)
    expected = {"qwen2": (4, (1,)), "mistral": (4, (0, 1)), "gemma2": (4, (0,)), "gemma3_text": (4, (0,))}
    assert (args.sliding_window, args.local_layers) == expected.get(model_type, (0, ()))
    assert args.qkv_bias == (model_type == "qwen2") and args.qk_norm == (model_type in ("qwen3", "gemma3_text"))
    assert args.rope_factor == (8.0 if model_type == "gemma3_text" else 0.0)  # linear, on the global layers only


def test_unknown_family_is_one_error_naming_the_supported_ones():
    with pytest.raises(UserError, match=r"'falcon'.*qwen2 \(Qwen2ForCausalLM\).*gemma3_text.*phi3.*bert"):
        args_from_hf({"model_type": "falcon"})


def test_phi3_long_context_rope_is_one_error():
    config = {"model_type": "phi3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4,
              "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    with pytest.raises(UserError, match="Phi-3: RoPE scaling 'longrope' is not supported"):
        args_from_hf(config)


def test_fine_tuned_family_exports_as_its_class(tmp_path, corpus, transformers):
    """model_args.json carries the family (hf_type, the window's layers), so a run fine-tuned from a Gemma 3 folder
    exports as a Gemma3ForCausalLM computing what the run's model computes."""
    from train_helpers import FINETUNE, train_here

    folder = tmp_path / "hf"
    make_hf_decoder(folder, "gemma3_text", corpus)
    train_here(tmp_path / "run", *FINETUNE, f"data.path={corpus}", f"model.init={folder}", "training.steps=1")
    trained, _ = load(tmp_path / "run")
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    tokens = torch.randint(0, back.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert relative_error(trained(tokens), back(tokens).logits) < 1e-4
