"""`scalenlp generate`: streams the continuation of a prompt; user mistakes end as one error line."""

import torch
from infer_helpers import make_export

from scalenlp.cli import main
from scalenlp.infer.engine import EOS_TOKEN, Engine, load_tokenizer_for
from scalenlp.infer.sampling import SamplingParams
from scalenlp.models.io import load_pretrained

torch.set_num_threads(1)


def test_generate_streams_the_greedy_text(tmp_path, capsys):
    export = make_export(tmp_path)
    tok = load_tokenizer_for(export)
    engine = Engine(load_pretrained(export), tok, eos_id=tok.token_to_id(EOS_TOKEN)).start()
    expected = engine.generate(["the quick"], SamplingParams(max_tokens=8, temperature=0))[0]
    engine.stop()
    # The run folder (export/ inside) is accepted as well as the export folder.
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "the quick", "--max-tokens", "8",
                 "--temperature", "0", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == "the quick" + expected + "\n"


def test_generate_user_errors(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: no exported model")
    export = make_export(tmp_path)
    assert main(["generate", "--checkpoint", str(export), "--prompt", "x", "--max-tokens", "5000"]) == 2
    assert "maximum context length" in capsys.readouterr().err
