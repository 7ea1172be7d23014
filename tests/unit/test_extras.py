"""Optional dependencies: a command whose extra is missing says which extra to install, in one line."""

import sys

import pytest

from scalenlp.cli import main
from scalenlp.errors import UserError, require


def test_a_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # None in sys.modules makes `import yaml` raise ImportError
    with pytest.raises(UserError, match=r"pip install 'scalenlp\[deploy\]'"):
        require("yaml", "deploy")
    assert require("json", "deploy") is sys.modules["json"]


def test_serve_without_the_serve_extra_is_one_error_line(monkeypatch, capsys, tiny_export):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--checkpoint", str(tiny_export)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: this needs the uvicorn package, which comes with scalenlp's 'serve' extra: "
                   "pip install 'scalenlp[serve]'"]


def test_import_scalenlp_needs_no_resource_module(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "resource", None)  # as on Windows
    for name in [m for m in sys.modules if m == "scalenlp" or m.startswith("scalenlp.")]:
        monkeypatch.delitem(sys.modules, name)
    scalenlp = importlib.import_module("scalenlp")
    importlib.import_module("scalenlp.hardware")
    assert scalenlp.__version__
