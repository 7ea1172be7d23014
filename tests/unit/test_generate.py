"""`scalenlp generate`: streams the continuation of a prompt; user mistakes end as one error line."""

import json
import queue

import pytest
import torch

from infer_helpers import make_export
from scalenlp.cli import main
from scalenlp.data.tokenizer import find_eos_token_id, load_tokenizer
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import Engine
from scalenlp.engine.llm import engine_from_checkpoint
from scalenlp.engine.sampling import SamplingParams
from scalenlp.models.io import load_pretrained, save_pretrained

torch.set_num_threads(1)


def test_generate_streams_the_greedy_text(tiny_export, capsys):
    export = tiny_export
    tok = load_tokenizer(export)
    engine = Engine(load_pretrained(export), tok, eos_id=find_eos_token_id(tok)).start()
    expected = engine.generate(["the quick"], SamplingParams(max_tokens=8, temperature=0))[0]
    engine.stop()
    # The run folder (export/ inside) is accepted as well as the export folder.
    assert main(["generate", "--checkpoint", str(export.parent), "--prompt", "the quick", "--max-tokens", "8",
                 "--temperature", "0", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == "the quick" + expected + "\n"


def test_generate_user_errors(tmp_path, tiny_export, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "does not exist" in err
    assert main(["generate", "--checkpoint", str(tiny_export), "--prompt", "x", "--max-tokens", "5000"]) == 2
    assert "maximum context length" in capsys.readouterr().err


@pytest.mark.parametrize("special, config, stops", [
    ("</s>", None, True),  # Llama-family name
    ("<|endoftext|>", None, True),
    ("<eos>", {"eos_token": {"content": "<eos>"}}, True),  # named only in the folder's tokenizer_config.json
    ("<pad>", None, False),  # no end-of-text token at all: generation runs to max_tokens
])
def test_generation_ends_at_the_tokenizers_end_of_text(tmp_path, special, config, stops):
    export = make_export(tmp_path, special=special)
    tok = load_tokenizer(export)
    special_id = tok.token_to_id(special)
    prompt = tok.encode("the quick").ids
    model = load_pretrained(export)
    with torch.no_grad():  # make the special token the greedy choice: its output row doubles the first choice's
        first = model(torch.tensor([prompt]))[0, -1].argmax()
        model.output.weight[special_id] = 2 * model.output.weight[first]
    save_pretrained(model, export, tmp_path / "tok.json")
    if config:
        (export / "tokenizer_config.json").write_text(json.dumps(config))
    engine = engine_from_checkpoint(EngineConfig(export, dtype="float32", device="cpu", max_batch=2))
    events = queue.Queue()
    try:
        engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0), events.put)
        deltas = [events.get()]
        while deltas[-1].finish_reason is None:
            deltas.append(events.get())
    finally:
        engine.stop()
    tokens = [t for d in deltas for t in d.token_ids]
    if stops:
        assert engine.eos_id == special_id
        assert (tokens, deltas[-1].finish_reason) == ([special_id], "stop")
    else:
        assert engine.eos_id is None
        assert (len(tokens), deltas[-1].finish_reason) == (6, "length") and tokens[0] == special_id
