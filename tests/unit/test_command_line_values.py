"""Command-line values are checked before a model is served: each bad one is one error line and exit code 2 (a
byte that is not UTF-8 in a new process's arguments: integration/test_commands.py); the API key comes from the
command line, a file or the environment."""

import pytest

from scalenlp.cli import main
from scalenlp.errors import UserError
from scalenlp.serving.limits import API_KEY_ENV, api_key_of


def test_api_key_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_of(None, None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key_of(None, None) == "from-env"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key_of(None, str(key_file)) == "from-file"
    assert api_key_of("from-argv", None) == "from-argv"
    key_file.write_text("\n")
    for bad in ((None, str(key_file)), (None, str(tmp_path / "missing")), ("a", str(key_file))):
        with pytest.raises(UserError):
            api_key_of(*bad)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "hi", "--seed", str(2**63)], "--seed"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "--prompt", "hi", "--top-k", str(2**63)], "--top-k"),
    (["generate", "--prompt", "\udcff"], "not valid Unicode"),  # how Python hands over a byte that is not UTF-8
    (["generate", "--prompt", "hi", "--max-seq-len", "-5"], "--max-seq-len"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes"),
    (["serve", "--max-prompt-chars", "0"], "--max-prompt-chars"),
    (["serve", "--read-timeout", "0"], "--read-timeout"),
    (["serve", "--keep-alive-timeout", "nan"], "--keep-alive-timeout"),
])
def test_cli_bad_values_are_one_error_line(tiny_export, capsys, argv, message):
    assert main(argv + ["--checkpoint", str(tiny_export), "--dtype", "float32", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
