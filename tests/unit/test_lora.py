"""LoRA / DoRA / QLoRA adapters (models/adapters.py, models/adapter_io.py, compress/nf4.py), in this process: a
fresh adapter is the identity and only adapters (and a classifier head) train; merging gives the adapted function;
PEFT's adapters load with equal logits and ours load in PEFT; a LoRA run checkpoints only what trains, resumes
exactly and exports the merged model with the adapter beside it; bad input is one line. Several processes under
each layout: tests/integration/test_lora_layouts.py."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from scalenlp.errors import ConfigError, UserError
from scalenlp.loader import load
from scalenlp.models import decoder as decoder_module
from scalenlp.models.adapter_io import ADAPTER_FOLDER, hf_module_names, read_adapter, write_adapter
from scalenlp.models.adapters import (
    LoRALinear,
    LoraSpec,
    adapter_weights,
    add_adapters,
    freeze_all_but_adapters,
    load_adapter_weights,
    match_targets,
    merge_adapters,
    pack_frozen,
)
from scalenlp.models.decoder import ModelArgs, Transformer
from scalenlp.models.frozen import COMPILABLE, MklPacked, frozen_operands
from train_helpers import (
    FINETUNE,
    SFT,
    checkpoint_keys,
    classify_sets,
    error_lines,
    main_train,
    tiny_encoder,
    train_here,
)

torch.set_num_threads(1)
ARGS = ModelArgs(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ARGS).eval()


def losses_backward(models: list[torch.nn.Module], tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each model's summed next-token loss on ``tokens``, after its backward pass."""
    losses = [model(tokens[:, :-1], targets=tokens[:, 1:]) for model in models]
    for loss in losses:
        loss.backward()
    return losses


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every adapter weight random values (a fresh B is zero, which would hide mistakes in B's use)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))


def test_a_fresh_adapter_is_the_identity_and_only_adapters_train():
    model, tokens = tiny(), torch.randint(0, ARGS.vocab_size, (2, 16))
    before = model(tokens)
    add_adapters(model, LoraSpec(rank=4, alpha=8), match_targets(model, "all-linear"))
    freeze_all_but_adapters(model)
    assert torch.equal(model(tokens), before)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A" in n or ".lora_B" in n for n in trained)
    assert len(trained) == 2 * 7 * ARGS.n_layers  # q, k, v, o, gate, up, down in every block; not the output
    model.train()
    model(tokens).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trained)


def test_targets_by_pattern_and_their_mistakes():
    model = tiny()
    assert match_targets(model, "attention.w[qv]") == ["layers.0.attention.wq", "layers.0.attention.wv",
                                                       "layers.1.attention.wq", "layers.1.attention.wv"]
    assert match_targets(model, r"layers\.1\.feed_forward.w2") == ["layers.1.feed_forward.w2"]
    with pytest.raises(ConfigError, match=r"matches no linear layer; they are named like layers\.0\.attention\.wk"):
        match_targets(model, "q_proj")
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        match_targets(model, "attention.w[qk")
    with pytest.raises(ConfigError, match=r"lora.rank=40 is larger than layer layers.0.attention.wq \(32 -> 32\)"):
        add_adapters(model, LoraSpec(rank=40, alpha=8), ["layers.0.attention.wq"])


@pytest.mark.parametrize("kind", ["lora", "rslora", "dora"])
def test_merging_gives_the_adapted_function(kind):
    model, tokens = tiny(), torch.randint(0, ARGS.vocab_size, (2, 16))
    spec = LoraSpec(rank=4, alpha=8, use_rslora=kind == "rslora", dora=kind == "dora")
    add_adapters(model, spec, match_targets(model, "all-linear"))
    perturb(model)
    adapted = model(tokens)
    base = tiny()(tokens)
    assert not torch.allclose(adapted, base, atol=1e-3)
    merged = merge_adapters(model)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    torch.testing.assert_close(merged(tokens), adapted, rtol=1e-4, atol=1e-5)


def test_rslora_scales_by_the_square_root_of_the_rank():
    assert LoraSpec(rank=16, alpha=32).scaling == 2
    assert LoraSpec(rank=16, alpha=32, use_rslora=True).scaling == 8


@pytest.fixture(scope="module")
def hf_pair(transformers):
    """A tiny transformers Llama and our model of it."""
    from scalenlp.models.hf import from_hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    hf = transformers.LlamaForCausalLM(config).eval()
    return hf, from_hf(hf)


@pytest.mark.parametrize("dora", [False, True])
def test_an_adapter_peft_made_loads_with_equal_logits(tmp_path, hf_pair, dora):
    from peft import LoraConfig, get_peft_model

    hf, ours = hf_pair
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                               use_dora=dora))
    perturb(peft_model, seed=2)
    peft_model.save_pretrained(tmp_path)
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        expected = peft_model(tokens).logits
    peft_model.unload()  # gives the transformers model back without adapters, for the other tests
    spec, weights = read_adapter(tmp_path, ours.args)
    assert spec == LoraSpec(rank=4, alpha=8, dora=dora) and len(weights) == 6
    model = ours.__class__(ours.args).eval()
    model.load_state_dict(ours.state_dict())
    add_adapters(model, spec, weights)
    load_adapter_weights(model, weights, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dora", [False, True])
def test_our_adapter_loads_in_peft_with_equal_logits(tmp_path, hf_pair, dora):
    from peft import PeftModel

    hf, ours = hf_pair
    model = ours.__class__(ours.args).eval()
    model.load_state_dict(ours.state_dict())
    spec = LoraSpec(rank=4, alpha=16, use_rslora=True, dora=dora)
    add_adapters(model, spec, match_targets(model, "all-linear"))
    perturb(model, seed=3)
    write_adapter(tmp_path, spec, adapter_weights(model), hf_module_names(model.args))
    tokens = torch.randint(0, 97, (2, 12))
    peft_model = PeftModel.from_pretrained(hf, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
    peft_model.unload()


def test_an_adapter_for_another_base_is_one_line(tmp_path):
    model = tiny()
    add_adapters(model, LoraSpec(rank=4, alpha=8), ["layers.0.attention.wq"])
    write_adapter(tmp_path / "ours", LoraSpec(rank=4, alpha=8), adapter_weights(model), None)
    other = Transformer(ModelArgs(vocab_size=97, dim=48, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=32))
    spec, weights = read_adapter(tmp_path / "ours", other.args)
    add_adapters(other, spec, weights)
    with pytest.raises(UserError, match=r"lora_A has shape \(4, 32\), this model's is \(4, 48\); the adapter was "
                                        r"made for another base model"):
        load_adapter_weights(other, weights, "lora.init")
    one_layer = Transformer(ModelArgs(vocab_size=97, dim=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=32))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    hf_named = {k.replace("layers.0.attention.wq", "model.layers.3.self_attn.q_proj"): v
                for k, v in load_file(tmp_path / "ours" / "adapter_model.safetensors").items()}
    from safetensors.torch import save_file

    (tmp_path / "peft").mkdir()
    save_file(hf_named, tmp_path / "peft" / "adapter_model.safetensors")
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps({**config, "scalenlp_names": False}))
    with pytest.raises(UserError, match="adapts model.layers.3.self_attn.q_proj, which this base model does not have"):
        read_adapter(tmp_path / "peft", one_layer.args)


# -- training runs -----------------------------------------------------------------------------------------------

LORA = ["lora.rank=4", "lora.alpha=8", "training.device=cpu"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, hf_llama, corpus):
    """Four LoRA steps on the session's Hugging Face Llama, a checkpoint every two, the export at the end."""
    run = tmp_path_factory.mktemp("lora") / "run"
    sets = [f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, *LORA, "training.steps=4",
            "checkpoint.every=2", "checkpoint.keep=2"]
    return run, sets, train_here(run, *sets)


def test_a_lora_run_checkpoints_only_the_adapters_and_resumes_exactly(lora_run, tmp_path):
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    run, sets, records = lora_run
    keys = FileSystemReader(str(run / "checkpoints" / "step-2")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A" in k or ".lora_B" in k for k in model_keys)
    assert any(k.startswith("optim.state.") and k.endswith("lora_B.exp_avg") for k in keys)
    resumed = tmp_path / "run"
    shutil.copytree(run / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    again = train_here(resumed, *sets, "checkpoint.resume=true")
    assert [r["loss"] for r in again] == [r["loss"] for r in records[2:]]


def test_a_lora_run_exports_the_merged_model_and_the_adapter(lora_run, hf_llama):
    run, _, records = lora_run
    assert records[-1]["loss"] < records[0]["loss"]
    merged, _ = load(run / "export")
    base, _ = load(hf_llama)
    spec, weights = read_adapter(run / "export" / ADAPTER_FOLDER, base.args)
    assert spec == LoraSpec(rank=4, alpha=8) and len(weights) == 7 * base.args.n_layers
    assert all(w.B.abs().sum() > 0 for w in weights.values())  # trained away from zero
    add_adapters(base, spec, weights)
    load_adapter_weights(base, weights, "export")
    tokens = torch.randint(0, base.args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), base(tokens), rtol=1e-4, atol=1e-5)


def test_a_lora_run_holds_its_frozen_base_in_a_layout_or_says_why_not(tmp_path, hf_llama, corpus, capsys):
    """lora.pack_frozen=onednn, transposed or mkl holds the base so in a float32 CPU run, with the plain run's loss;
    under bf16 autocast cast, onednn and transposed hold it cast to bf16, with the bf16 run's loss (cast: the very
    products autocast computes), and mkl (float32's) leaves it as it is with the reason; off, nothing is said."""
    sets = [f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, *LORA, "training.steps=1", "checkpoint.every=0",
            "checkpoint.export=false"]
    plain = train_here(tmp_path / "plain", *sets, "lora.pack_frozen=off")
    assert "lora.pack_frozen" not in capsys.readouterr().err
    for layout, held in [("onednn", r"as oneDNN-packed W and W\^T"), ("transposed", r"beside a row-major copy of W\^T"),
                         ("mkl", "beside an MKL-packed copy of W")]:
        packed = train_here(tmp_path / layout, *sets, f"lora.pack_frozen={layout}")
        assert re.search(rf"^lora.pack_frozen: [1-9]\d* frozen linears held {held}$", capsys.readouterr().err, re.M)
        assert packed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    bf16 = [*sets, "training.mixed_precision=bf16"]
    plain = train_here(tmp_path / "bf16", *bf16, "lora.pack_frozen=off")
    capsys.readouterr()
    for layout, held, rel in [("cast", "beside a copy of W", 1e-6), ("onednn", r"as oneDNN-packed W and W\^T", 1e-2),
                              ("transposed", r"beside a row-major copy of W\^T", 1e-2)]:
        packed = train_here(tmp_path / f"bf16-{layout}", *bf16, f"lora.pack_frozen={layout}")
        assert re.search(rf"^lora.pack_frozen: [1-9]\d* frozen linears held {held} cast to bf16$",
                         capsys.readouterr().err, re.M)
        assert packed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=rel)
    train_here(tmp_path / "bf16-mkl", *bf16, "lora.pack_frozen=mkl")
    assert ("lora.pack_frozen: the frozen base kept as it is; not packed: MKL packs float32 weights, and this run "
            "computes the products in torch.bfloat16 (autocast)\n") in capsys.readouterr().err
    train_here(tmp_path / "cast", *sets, "lora.pack_frozen=cast")
    assert ("not packed: cast holds the base in training.mixed_precision's dtype, and this run computes in "
            "float32\n") in capsys.readouterr().err


@pytest.mark.slow  # compiling the tiny model's blocks and loss: ~20-40 s here
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile's CPU backend needs a C++ compiler (g++)")
def test_a_compiled_lora_run_holds_its_base_in_the_layouts_compile_takes(tmp_path, hf_llama, corpus, capsys):
    """Under training.compile, lora.pack_frozen=mkl holds the base as it does eagerly, with the eager run's loss;
    oneDNN's packed weights are left out, with the reason."""
    sets = [f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, *LORA, "training.steps=1", "checkpoint.every=0",
            "checkpoint.export=false"]
    eager = train_here(tmp_path / "eager", *sets, "lora.pack_frozen=mkl")
    capsys.readouterr()
    compiled = train_here(tmp_path / "compiled", *sets, "lora.pack_frozen=mkl", "training.compile=true")
    assert re.search(r"^lora.pack_frozen: [1-9]\d* frozen linears held beside an MKL-packed copy of W$",
                     capsys.readouterr().err, re.M)
    assert compiled[0]["loss"] == pytest.approx(eager[0]["loss"], rel=1e-5)
    train_here(tmp_path / "onednn", *sets, "lora.pack_frozen=onednn", "training.compile=true")
    assert ("lora.pack_frozen: the frozen base kept as it is; not packed: training.compile lowers the products "
            "itself, and cannot take oneDNN's packed weights\n") in capsys.readouterr().err


@pytest.mark.parametrize("packed_time", [0.5, 2.0])
def test_lora_pack_frozen_auto_packs_where_the_packed_products_measured_faster(tmp_path, hf_llama, corpus, capsys,
                                                                                monkeypatch, packed_time):
    """lora.pack_frozen=auto (the default) times the base's products once (here a fake timing: the transposed
    layout at half or twice the plain time, oneDNN's slower still) and takes a layout only where it was faster,
    saying why; the next run reads the cache."""
    from scalenlp.train import frozen_packing

    monkeypatch.delenv("SCALENLP_PACK_FROZEN")  # tests/conftest.py decides it for every other test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    timed = []

    def fake(shapes, rows, counts, dtype):
        timed.append((shapes, rows))
        return {"plain": [[1e-3] * len(shapes)], "onednn": [[3e-3] * len(shapes)],
                "transposed": [[packed_time * 1e-3] * len(shapes)], "mkl": [[3e-3] * len(shapes)]}

    monkeypatch.setattr(frozen_packing, "time_products", fake)
    sets = [f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, *LORA, "training.steps=1", "checkpoint.every=0",
            "checkpoint.export=false"]
    for run in ("first", "second"):
        train_here(tmp_path / run, *sets)
        line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("lora.pack_frozen:"))
        if packed_time < 1:
            assert re.match(r"lora.pack_frozen: [1-9]\d* frozen linears held beside a row-major copy of W\^T "
                            r"\(auto: measured 2.00x as fast \(the frozen products of a step", line), line
        else:
            assert line.startswith("lora.pack_frozen: the frozen base kept as it is (auto: no layout of onednn, "
                                   "transposed, mkl at least 1.05x as fast as plain"), line
        assert ("measured now, " in line) == (run == "first")
    [(shapes, rows)] = timed  # once: the second run read the cache
    # A step's rows (batch 4 of 32 tokens); the tiny Llama's k/v, q/o, gate/up, its frozen (tied) output
    # projection and down, each once.
    assert rows == 4 * 32 and shapes == [(64, 32), (64, 64), (64, 176), (64, 402), (176, 64)]


def test_lora_init_continues_from_an_adapter(lora_run, hf_llama, corpus, tmp_path):
    run, _, _ = lora_run
    adapter = run / "export" / ADAPTER_FOLDER
    records = train_here(tmp_path / "run", f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE,
                         f"lora.init={adapter}", "training.device=cpu", "training.steps=1", "training.lr=1e-9",
                         "checkpoint.every=0", "checkpoint.export=false")
    fresh = train_here(tmp_path / "fresh", f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, *LORA,
                       "training.steps=1", "checkpoint.every=0", "checkpoint.export=false")
    assert records[0]["loss"] < fresh[0]["loss"] - 0.01  # started where the first run ended, not from the base


def test_lora_trains_a_classifier_head_beside_the_adapters(tmp_path, transformers):
    from scalenlp.models.encoder import Encoder

    init = tiny_encoder(tmp_path / "encoder")
    rows = "\n".join(f"{'good fine great' if i % 2 else 'bad awful poor'} film {i}\t{i % 2}" for i in range(24))
    (tmp_path / "train.tsv").write_text("sentence\tlabel\n" + rows + "\n")
    train_here(tmp_path / "run", *classify_sets(init, tmp_path / "train.tsv", None), *LORA, "training.steps=3",
               "training.global_batch_size=8", "training.seq_len=16", "lora.targets=attention.w[qv]")
    keys = checkpoint_keys(tmp_path / "run" / "checkpoints" / "step-3")
    assert {"model.classifier.weight", "model.classifier.bias"} <= keys
    assert all(".lora_" in k or "classifier" in k for k in keys if k.startswith("model."))
    model, _ = load(tmp_path / "run")
    assert isinstance(model, Encoder) and model.classifier.weight.shape[0] == 2


def test_lora_fine_tunes_a_chat_model(tmp_path, hf_llama, chats):
    records = train_here(tmp_path / "run", *SFT, f"data.path={chats}", f"model.init={hf_llama}", *LORA,
                         "lora.targets=attention.w[qv]", "training.steps=4", "checkpoint.every=0")
    assert records[-1]["loss"] < records[0]["loss"]
    keys = checkpoint_keys(tmp_path / "run" / "checkpoints" / "step-4")
    assert {k for k in keys if k.startswith("model.")} == {f"model.layers.{i}.attention.{w}.lora_{m}" for i in (0, 1)
                                                          for w in ("wq", "wv") for m in "AB"}


def test_qlora_holds_the_base_in_nf4_and_learns(tmp_path, hf_llama, corpus):
    pytest.importorskip("torchao")
    from scalenlp.compress.nf4 import quantize_nf4

    model = tiny()
    quantize_nf4(model, ["layers.0.attention.wq"])
    assert type(model.layers["0"].attention.wq.weight).__name__ == "NF4Tensor"
    records = train_here(tmp_path / "run", f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, *LORA,
                         "lora.quantize_base=nf4", "training.steps=4", "checkpoint.every=0")
    assert records[-1]["loss"] < records[0]["loss"]
    merged, _ = load(tmp_path / "run")  # the export: the dequantized base with the adapters folded in
    assert merged.layers["0"].attention.wq.weight.dtype == torch.float32


@pytest.mark.parametrize("shape", [(64, 64), (32, 64), (176, 64), (64, 176), (576, 576), (1536, 576)])
def test_an_nf4_weight_splits_into_row_shards_of_whole_scale_groups(shape):
    """ZeRO-2/3 split an NF4 weight by rows (torchao chunks each inner tensor evenly): each shard of up to
    SHARDS dequantizes by itself to the rows it holds, so shards gathered per use give the weight of one process."""
    pytest.importorskip("torchao")
    from scalenlp.compress.nf4 import SHARDS, quantize_nf4

    model = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=False))
    quantize_nf4(model, ["0"])
    whole = model[0].weight.get_original_weight()
    for shards in (2, SHARDS):
        rows = torch.cat([shard.get_original_weight() for shard in torch.chunk(model[0].weight, shards)])
        assert torch.equal(rows, whole), (shape, shards)


def test_an_nf4_base_that_zero3_cannot_split_is_one_line():
    from scalenlp.compress.nf4 import check_shardable

    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Linear(64, 3))
    check_shardable(model, ["0"], 8)
    with pytest.raises(ConfigError, match=r"0 \(16 x 64, 8 groups\) does not split so: use fewer parallel.dp_shard"):
        check_shardable(model, ["0"], 16)  # whole rows, but not whole scale groups
    with pytest.raises(ConfigError, match=r"1 \(3 x 64, 3 groups\) does not split so"):
        check_shardable(model, ["0", "1"], 2)  # not whole rows


@pytest.mark.parametrize("bf16_device", [True, False])
def test_an_nf4_base_computes_in_bf16_on_a_gpu_and_in_float32_on_the_cpu(monkeypatch, bf16_device):
    """QLoRA's products: bf16 on a GPU (played here); on the CPU the NF4 weight dequantized to float32, forward
    and backward, with the same output and input gradient as a float32 linear of the dequantized weight, and no
    tensor of the step kept for backward (the weight is dequantized again)."""
    pytest.importorskip("torchao")
    from scalenlp.compress.nf4 import quantize_nf4
    from scalenlp.models import adapters

    if bf16_device:
        monkeypatch.setattr(adapters, "dequantizes_to_float32", lambda device: False)
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(128, 64))
    quantize_nf4(layer, ["0"])
    nf4 = layer[0].weight
    x = torch.randn(3, 5, 128, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = adapters.base_product(x, nf4, layer[0].bias)
    out.sum().backward()
    dequantized = nf4.get_original_weight()
    assert torch.equal(adapters.float32_nf4(nf4), dequantized.float())
    reference_x = x.detach().clone().requires_grad_()
    if bf16_device:
        reference = F.linear(reference_x.to(torch.bfloat16), dequantized) + layer[0].bias  # torchao adds it apart
    else:
        reference = F.linear(reference_x, dequantized.float(), layer[0].bias)
        assert kept == []
    reference.sum().backward()
    assert out.dtype == torch.float32 and torch.equal(out, reference)
    assert torch.equal(x.grad, reference_x.grad)


@pytest.mark.parametrize("colwise", [True, False])
def test_under_tp_each_rank_holds_its_shard_in_nf4_and_computes_its_part(colwise, monkeypatch):
    """QLoRA under tensor parallelism: after the plan has cut a frozen linear, each rank quantizes its shard by
    itself (a plain NF4 tensor) and the layer gives that rank's part of the product with it, in bf16 as an NF4
    base computes (on a GPU, as played here): its output columns (column-parallel), or its
    partial sum over its input columns (row-parallel, which the style all-reduces). Each of 2 ranks is played in
    turn on a fake process group, whose collectives do nothing, so what comes out is the rank's own part."""
    pytest.importorskip("torchao")
    from scalenlp.models import adapters

    monkeypatch.setattr(adapters, "dequantizes_to_float32", lambda device: False)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scalenlp.compress.nf4 import quantize_nf4
    from scalenlp.parallel.nf4_shards import NF4ShardLinear, quantize_tp_shards

    torch.manual_seed(0)
    whole = torch.randn(128, 192) * 0.05
    x = torch.randn(2, 3, 192)
    for rank in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            model = torch.nn.Sequential(torch.nn.Linear(192, 128, bias=False))
            model[0].weight.data.copy_(whole)
            # src_data_rank=None: each rank cuts its shard itself, as the fake group's scatter moves nothing.
            parallelize_module(model, init_device_mesh("cpu", (2,)),
                               {"0": ColwiseParallel() if colwise else RowwiseParallel()}, src_data_rank=None)
            quantize_tp_shards(model, ["0"])
            part = model(x if colwise else x.chunk(2, -1)[rank])
        finally:
            dist.destroy_process_group()
        layer = model[0]
        assert type(layer) is NF4ShardLinear and type(layer.weight).__name__ == "NF4Tensor"
        alone = torch.nn.Sequential(torch.nn.Linear(1, 1, bias=False))  # the rank's shard quantized by itself
        alone[0].weight = torch.nn.Parameter(whole.chunk(2, 0 if colwise else 1)[rank].contiguous())
        quantize_nf4(alone, ["0"])
        dequantized = alone[0].weight.get_original_weight()
        assert torch.equal(layer.weight.get_original_weight(), dequantized)
        inputs = x if colwise else x.chunk(2, -1)[rank]
        assert torch.equal(part, torch.nn.functional.linear(inputs.to(torch.bfloat16), dequantized).float())


def test_a_fresh_dora_magnitude_follows_a_base_changed_after_it():
    """Under TP a QLoRA base is quantized after the adapters are added (shard by shard): a fresh DoRA adapter's
    magnitudes are then set again to the quantized base's row norms, so it starts as the identity of that base
    (with the full-precision norms, the tiny Llama's first QLoRA + DoRA loss under TP 2 moved by 5e-4)."""
    from scalenlp.parallel.nf4_shards import reset_magnitudes

    model = tiny()
    add_adapters(model, LoraSpec(rank=2, alpha=4, dora=True), ["layers.0.attention.wq"])
    layer, tokens = model.layers["0"].attention.wq, torch.randint(0, ARGS.vocab_size, (2, 16))
    base = tiny()
    with torch.no_grad():
        layer.weight.mul_(1.5)
        base.layers["0"].attention.wq.weight.mul_(1.5)
    assert not torch.allclose(model(tokens), base(tokens))  # the magnitudes rescale the rows back
    reset_magnitudes(model)
    torch.testing.assert_close(model(tokens), base(tokens))


@pytest.mark.parametrize("layout", [None, "onednn", "transposed", "mkl", "nf4"])
def test_a_lora_layer_is_one_autograd_node_with_the_products_gradients(layout):
    """Plain LoRA (no DoRA, no dropout in training) runs as one autograd node, the base as it is, in a layout or
    in NF4 (dequantized to float32 on the CPU): the output and the gradients of the input, A and B those of
    x W^T + b + s (x A^T) B^T computed op by op."""
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 136)
    if layout == "nf4":
        pytest.importorskip("torchao")
        from scalenlp.compress.nf4 import quantize_nf4
        from scalenlp.models.adapters import float32_nf4

        quantize_nf4(torch.nn.Sequential(base), ["0"])
    layer = LoRALinear(base, LoraSpec(rank=4, alpha=12))
    with torch.no_grad():
        layer.lora_B.normal_()
    weight = float32_nf4(base.weight) if layout == "nf4" else base.weight.detach().clone()
    bias = base.bias.detach().clone()
    if layout in ("onednn", "transposed", "mkl"):
        layer.pack_base(2 * 5, layout)
    x = torch.randn(2, 5, 64, requires_grad=True)
    out = layer(x)
    assert type(out.grad_fn).__name__ == "_LoRAProductsBackward"
    grad = torch.randn_like(out)
    out.backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    A, B = (layer.lora_A.detach().clone().requires_grad_(), layer.lora_B.detach().clone().requires_grad_())
    expected = F.linear(x_ref, weight, bias) + 3.0 * F.linear(F.linear(x_ref, A), B)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in ((x.grad, x_ref.grad), (layer.lora_A.grad, A.grad), (layer.lora_B.grad, B.grad)):
        # float32 sums in another order (the scaling applied to the rank-wide product): within 1e-5 of the largest
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    # An input that takes no gradient (the first block's, under a frozen embedding) gets none computed.
    layer.zero_grad()
    layer(x.detach()).backward(grad)
    assert layer.lora_A.grad is not None and layer.lora_B.grad is not None


@pytest.mark.parametrize("targets", ["all-linear", "attention.w[qv]|feed_forward.w1"])
def test_layers_reading_one_input_share_one_node_with_each_layers_gradients(targets):
    """With training.stack_projections (the default), q/k/v and gate/up, all adapted, run as one node over their
    stacked A's, their frozen bases in any mix of layouts: the loss and every adapter's gradient those of the layers
    run one by one. Where only some of them are adapted (peft's q/v habit), each runs alone: the stacked product
    of the frozen weights would drop the adapters' terms."""
    from scalenlp.models.adapters import lora_products
    from scalenlp.models.decoder import stack_projections

    model = tiny()
    add_adapters(model, LoraSpec(rank=4, alpha=8), match_targets(model, targets))
    freeze_all_but_adapters(model)
    attention = model.layers["0"].attention
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoRALinear):
                layer.lora_B.normal_()
    if targets == "all-linear":
        attention.wq.pack_base(8, "onednn")
        attention.wk.pack_base(8, "transposed")
        attention.wv.pack_base(2 * 9, "mkl")
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9))
    results = []
    for stacked in (True, False):
        stack_projections(model, stacked)
        model.zero_grad()
        loss = losses_backward([model], tokens)[0]
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (alone_loss, alone) = results
    torch.testing.assert_close(loss, alone_loss, rtol=1e-6, atol=0)
    for name, grad in alone.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name)
    x = torch.randn(2, 9, ARGS.dim, requires_grad=True)
    parts = (attention.wq, attention.wk, attention.wv)
    if targets == "all-linear":
        q, k, v = lora_products(x, parts)
        assert q.grad_fn is k.grad_fn is v.grad_fn and q.grad_fn.name() == "_LoRAProductsBackward"
        attention.wk.scaling *= 2  # layers of different scalings run apart
        assert lora_products(x, parts) is None
    else:
        assert decoder_module.stacked_linear(x, parts) is None


def test_dropout_and_dora_take_the_general_path_autocast_the_node_in_its_dtype():
    torch.manual_seed(0)
    x = torch.randn(3, 32)
    for spec in (LoraSpec(rank=4, alpha=8, dropout=0.1), LoraSpec(rank=4, alpha=8, dora=True)):
        assert type(LoRALinear(torch.nn.Linear(32, 32), spec).train()(x).grad_fn).__name__ == "AddBackward0"
    dropout = LoRALinear(torch.nn.Linear(32, 32), LoraSpec(rank=4, alpha=8, dropout=0.1)).eval()
    assert dropout(x.requires_grad_()).grad_fn.name() == "_LoRAProductsBackward"  # no dropout in evaluation
    # Under bf16 autocast, the node's products in bf16 as nn.Linear's: the op-by-op layer's output and gradients
    # (the adapters' in float32, their masters' dtype) to bf16's precision.
    layer = LoRALinear(torch.nn.Linear(32, 48), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():
        layer.lora_B.normal_()
    reference = copy.deepcopy(layer)
    reference._lora_operands = lambda x: None
    grad = torch.randn(3, 48)
    got, want = [], []
    for model, into in ((layer, got), (reference, want)):
        inputs = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(inputs)
        out.float().backward(grad)
        into += [out, inputs.grad, model.lora_A.grad, model.lora_B.grad]
    assert got[0].grad_fn.name() == "_LoRAProductsBackward" and got[0].dtype == torch.bfloat16
    assert got[2].dtype == got[3].dtype == torch.float32 and got[1].dtype == torch.float32
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * b.abs().max().item())
    layer.pack_base(3, "transposed")  # a float32 layout under autocast: the node on the weight, cast by autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.grad_fn.name() == "_LoRAProductsBackward" and torch.equal(out, got[0])
    layer.pack_base(3, "onednn")  # its weight dropped: the general path, the base in float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.grad_fn.name() == "AddBackward0"


def adapted_model(dora: bool = False) -> Transformer:
    """A 2-layer model whose every block linear has a rank-4 adapter (random A and B), only those training, of
    widths that are no multiple of oneDNN's blocks (48 in, 136 hidden)."""
    args = ModelArgs(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=136, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args).train()
    add_adapters(model, LoraSpec(rank=4, alpha=8, dora=dora), match_targets(model, "all-linear"))
    freeze_all_but_adapters(model)
    perturb(model)
    return model


@pytest.mark.parametrize("layout", ["onednn", "transposed", "mkl"])
@pytest.mark.parametrize("dora", [False, True])
def test_a_packed_frozen_base_gives_the_plain_loss_and_gradients(dora, layout):
    """lora.pack_frozen: the base held as oneDNN-packed W and W^T instead of its weight, or beside a row-major W^T
    or an MKL-packed W (and the frozen output projection's operands beside it), same loss and adapter gradients in
    float32 (widths that are no multiple of oneDNN's blocks: 48 in, 136 hidden)."""
    plain = adapted_model(dora)
    args = plain.args
    packed = copy.deepcopy(plain)
    weights = {name: m.weight.detach().clone() for name, m in packed.named_modules() if isinstance(m, LoRALinear)}
    assert pack_frozen(packed, 2 * 16, layout) == (Counter({layout: len(weights) + 1}), [])  # and the head
    onednn = layout == "onednn"
    assert type(packed.output_packed[0]) is (MklPacked if layout == "mkl" else torch.Tensor)
    assert packed.output_packed[1].is_mkldnn == onednn
    names = dict(packed.named_parameters())
    # oneDNN's packed copies replace the weight; the transposed copy and MKL's packed W are read beside it.
    assert all((f"{name}.weight" in names) != onednn for name in weights)
    for name, weight in weights.items():
        layer = packed.get_submodule(name)
        assert layer.packed[1].is_mkldnn == onednn and torch.equal(layer.dense_weight(), weight)
        if not onednn:
            assert layer.packed[1].data_ptr() == layer.weight.data_ptr()  # W itself, not a copy
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    losses = losses_backward([plain, packed], tokens)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    trained = [name for name, p in plain.named_parameters() if p.requires_grad]
    for name in trained:
        torch.testing.assert_close(names[name].grad, plain.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    assert pack_frozen(packed, 32, layout) == (Counter(), [])  # a packed model has nothing left to pack
    packed.output_packed = frozen_operands(torch.zeros(args.vocab_size, args.dim), layout, 2 * 16)  # the loss reads:
    with torch.no_grad():  # all-zero logits cost log(vocab) a target
        assert packed(tokens[:, :-1], targets=tokens[:, 1:]).item() == pytest.approx(32 * math.log(97))


@pytest.mark.parametrize("layout", ["cast", "onednn", "transposed"])
def test_a_base_held_cast_for_autocast_gives_autocasts_loss_and_float32_outside_it(layout):
    """lora.pack_frozen under training.mixed_precision=bf16: the base and the frozen output projection held cast to
    bf16 once give the loss and adapter gradients of the model that autocast casts every step (cast: the very same
    products, bit for bit; oneDNN's and the transposed copy's within bf16's rounding); outside autocast the model
    reads its float32 weights, as the unpacked one does, and each weight comes back exactly for merging."""
    plain = adapted_model()
    args = plain.args
    held = copy.deepcopy(plain)
    assert pack_frozen(held, 2 * 16, layout, torch.bfloat16) == (Counter({layout: 2 * 7 + 1}), [])
    assert held.output_packed[1].dtype == torch.bfloat16
    for name, layer in held.named_modules():
        if isinstance(layer, LoRALinear):
            assert layer.packed[1].dtype == torch.bfloat16
            assert torch.equal(layer.dense_weight(), plain.get_submodule(name).weight)
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward, as the trainer runs it
        losses = [model(tokens[:, :-1], targets=tokens[:, 1:]) for model in (plain, held)]
    for loss in losses:
        loss.backward()
    rtol = 0 if layout == "cast" else 2e-2
    torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=0)
    for (name, p), q in zip(plain.named_parameters(), held.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=rtol * p.grad.abs().max().item(), msg=name)
    with torch.no_grad():
        assert torch.equal(held(tokens[:, :-1], targets=tokens[:, 1:]), plain(tokens[:, :-1], targets=tokens[:, 1:]))
    with pytest.raises(ValueError, match="packs float32 weights, not torch.bfloat16"):
        frozen_operands(torch.randn(8, 4), "mkl", 4, torch.bfloat16)
    assert pack_frozen(copy.deepcopy(plain), 32, "mkl", torch.bfloat16) == (
        Counter(), ["MKL packs float32 weights, and this run computes the products in torch.bfloat16 (autocast)"])


def test_mkls_packed_weight_computes_its_rows_and_any_other_from_the_weight():
    """The mkl layout: x W^T (+ b) on W packed for 12 rows equals F.linear's bit for bit (the same MKL kernel,
    without repacking W), for inputs of those rows and of others (read from W itself), with or without a bias and
    added into a given output; the input gradient's operand is W itself; a row count is required."""
    from scalenlp.models.frozen import frozen_dense, frozen_product

    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    operands = frozen_operands(weight, "mkl", 12)
    assert operands[1].data_ptr() == frozen_dense(operands).data_ptr() == weight.data_ptr()  # W itself
    assert operands[0].dtype == torch.float32
    for x in (torch.randn(3, 4, 24), torch.randn(5, 24)):  # 12 rows, packed; 5 rows, from W
        assert torch.equal(frozen_product(x, operands[0], bias), F.linear(x, weight, bias))
        into = torch.randn(x.numel() // 24, 40)
        torch.testing.assert_close(frozen_product(x.reshape(-1, 24), operands[0], into=into.clone()),
                                   into + x.reshape(-1, 24) @ weight.t())
    with pytest.raises(ValueError, match="packs W for a number of rows"):
        frozen_operands(weight, "mkl", None)


@pytest.mark.slow  # compiling the blocks and the loss takes ~30-60 s here
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile's CPU backend needs a C++ compiler (g++)")
@pytest.mark.parametrize("layout, dtype", [("transposed", torch.float32), ("mkl", torch.float32),
                                           ("cast", torch.bfloat16)])
def test_compiled_blocks_read_the_frozen_base_in_the_layouts_compile_takes(layout, dtype):
    """training.compile takes lora.pack_frozen=transposed and mkl (not oneDNN's opaque packed weights), and cast
    under bf16 autocast, and the node of q/k/v and of gate/up (stack_projections): the compiled blocks and loss on
    the held copies give the plain eager model's loss and adapter gradients, its layers run one by one (in bf16,
    within its rounding: Inductor rounds the fused elementwise passes in between apart)."""
    from scalenlp.models.decoder import stack_projections
    from scalenlp.parallel.parallelize import apply_compile

    assert layout in COMPILABLE
    plain = adapted_model()
    args = plain.args
    compiled = copy.deepcopy(plain)
    assert pack_frozen(compiled, 2 * 16, layout, dtype)[0] == Counter({layout: 2 * 7 + 1})
    stack_projections(compiled, True)
    apply_compile(compiled)
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
        losses = [model(tokens[:, :-1], targets=tokens[:, 1:]) for model in (plain, compiled)]
    for loss in losses:
        loss.backward()
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 0)
    torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=0)
    for (name, p), q in zip(plain.named_parameters(), compiled.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol * 10, atol=atol or rtol * p.grad.abs().max().item(),
                                       msg=name)


def test_pack_frozen_leaves_what_it_cannot_pack_with_the_reason():
    """A bf16 base, an NF4 one (QLoRA) and a tensor-parallel shard (DTensor) keep their weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scalenlp.parallel.tensor_parallel import apply_tp

    model = tiny().to(torch.bfloat16)
    add_adapters(model, LoraSpec(rank=2, alpha=4), match_targets(model, "all-linear"))
    assert pack_frozen(model, 32, "transposed") == (Counter(), ["the base is torch.bfloat16, the layouts are for float32"])
    model = tiny()
    add_adapters(model, LoraSpec(rank=2, alpha=4), match_targets(model, "all-linear"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_tp(model, init_device_mesh("cpu", (2,)), sequence_parallel=False)
    finally:
        dist.destroy_process_group()
    assert pack_frozen(model, 32, "onednn") == (Counter(), ["the base is sharded (tensor parallelism or ZeRO/FSDP), "
                                                            "its products run on shards"])
    pytest.importorskip("torchao")
    from scalenlp.compress.nf4 import quantize_nf4

    model = tiny()
    quantize_nf4(model, ["layers.0.attention.wq", "layers.0.attention.wk"])
    add_adapters(model, LoraSpec(rank=2, alpha=4), ["layers.0.attention.wq", "layers.0.attention.wk"])
    freeze_all_but_adapters(model)
    # QLoRA's frozen output projection stays unpacked too: two more copies of it would spend what NF4 saved.
    assert pack_frozen(model, 32, "transposed") == (Counter(), ["an NF4 base (QLoRA) is dequantized per use"])
    assert model.layers["0"].attention.wq.packed is None and model.output_packed is None


def test_tensor_parallelism_keeps_the_frozen_weights_frozen():
    """Sequence parallelism's style (the norms') makes new parameters, which would train: a LoRA run's frozen
    norms stay frozen under TP with it (their gradients counted in the norm moved it by 1.5% on the tiny Llama).
    The layout alone is looked at, on a fake 2-rank process group (its collectives do nothing)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scalenlp.parallel.tensor_parallel import apply_tp

    model = tiny()
    add_adapters(model, LoraSpec(rank=2, alpha=4), match_targets(model, "all-linear"))
    freeze_all_but_adapters(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_tp(model, init_device_mesh("cpu", (2,)), sequence_parallel=True)
    finally:
        dist.destroy_process_group()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name for name in trained), trained


def test_an_nf4_base_whose_tp_shards_are_not_whole_blocks_is_one_line():
    """Under TP each rank quantizes its shard, which must be whole NF4 blocks (checked before any process starts):
    wq is split by its rows, wo by its columns."""
    from scalenlp.compress.nf4 import check_shardable
    from scalenlp.parallel.tensor_parallel import split_dim

    def block(wq: tuple[int, int], wo: tuple[int, int]) -> torch.nn.Module:
        attention = torch.nn.ModuleDict({"wq": torch.nn.Linear(wq[1], wq[0]), "wo": torch.nn.Linear(wo[1], wo[0])})
        return torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"attention": attention})})})

    names = ["layers.0.attention.wq", "layers.0.attention.wo"]
    check_shardable(block((16, 24), (8, 48)), names, 1, 2, split_dim)  # shards of 8 x 24 each: three blocks
    with pytest.raises(ConfigError, match=r"under parallel.tp=2 quantizes each rank's shard in blocks of 64 "
                                          r"weights; layers.0.attention.wo \(8 x 12 on each tensor-parallel rank\) "
                                          r"is not whole blocks: use another parallel.tp"):
        check_shardable(block((16, 24), (8, 24)), names, 1, 2, split_dim)  # three blocks whole, one and a half split
    with pytest.raises(ConfigError, match=r"layers.0.attention.wq \(4 x 64 on each tensor-parallel rank, 4 groups\) "
                                          r"does not split so"):
        check_shardable(block((8, 64), (8, 64)), names, 8, 2, split_dim)  # ZeRO-3 over 8 ranks: 4 rows of a TP shard


def test_lora_mistakes_are_one_line(tmp_path, hf_llama, corpus, capsys):
    base = [f"model.init={hf_llama}", f"data.path={corpus}", *FINETUNE, "training.steps=1"]
    cases = [
        (["lora.rank=4", "lora.targets=q_proj"], "lora.targets='q_proj' matches no linear layer"),
        (["lora.rank=128"], "lora.rank=128 is larger than layer layers.0.attention.wq (64 -> 64)"),
        (["lora.alpha=4"], "lora.alpha is set but LoRA is off"),
        (["lora.rank=4", "lora.quantize_base=nf8"], "lora.quantize_base='nf8' is not one of  | nf4"),
        ([f"lora.init={tmp_path}"], "is not an adapter folder"),
    ]
    for sets, message in cases:
        assert main_train(tmp_path / "run", *base, *sets) == 2
        lines = error_lines(capsys.readouterr().err)
        assert len(lines) == 1 and message in lines[0], (sets, lines)
    assert main_train(tmp_path / "run", "lora.rank=4", "training.steps=1") == 2
    assert "LoRA fine-tunes a pretrained model: set model.init" in error_lines(capsys.readouterr().err)[0]
    # Checked before any process starts: 16 ZeRO-3 shards of layers.0.attention.wq's 8 scale groups.
    assert main_train(tmp_path / "run", *base, "lora.rank=4", "lora.quantize_base=nf4", "parallel.data_parallel=zero3",
                      "training.global_batch_size=16", nproc=16) == 2
    assert "layers.0.attention.wq (64 x 64, 8 groups) does not split" in error_lines(capsys.readouterr().err)[0]



# -- export ------------------------------------------------------------------------------------------------------

def test_export_peft_loads_in_peft_onto_the_base_with_the_runs_logits(lora_run, hf_llama, tmp_path, transformers):
    from peft import PeftModel

    from scalenlp.cli import main

    run, _, _ = lora_run
    assert main(["export", "--checkpoint", str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_modules"][0].startswith(
        "model.layers.0.")
    peft_model = PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(hf_llama), tmp_path / "peft")
    merged, _ = load(run)
    tokens = torch.randint(0, merged.args.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, merged(tokens), rtol=1e-4, atol=1e-4)
    # --merge folds a PEFT adapter into its base: the merged transformers model computes what PEFT's does.
    assert main(["export", "--checkpoint", str(hf_llama), "--adapter", str(tmp_path / "peft"), "--merge",
                 "--format", "hf", "--out", str(tmp_path / "merged")]) == 0
    hf_merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(hf_merged(tokens).logits, merged(tokens), rtol=1e-4, atol=1e-4)


def test_export_mistakes_are_one_line(lora_run, hf_llama, tmp_path, capsys):
    from scalenlp.cli import main

    run, _, _ = lora_run
    cases = [
        (["--checkpoint", str(hf_llama), "--format", "peft"], "holds no LoRA adapter"),
        (["--checkpoint", str(hf_llama), "--format", "hf", "--merge"], "--merge needs --adapter"),
        (["--checkpoint", str(hf_llama), "--format", "hf", "--adapter", str(run / "export" / ADAPTER_FOLDER)],
         "--adapter is folded in by --merge"),
        (["--checkpoint", str(run), "--format", "peft", "--merge"], "--merge writes a whole model"),
    ]
    for argv, message in cases:
        assert main(["export", *argv, "--out", str(tmp_path / "out")]) == 2
        lines = error_lines(capsys.readouterr().err)
        assert len(lines) == 1 and message in lines[0], (argv, lines)
