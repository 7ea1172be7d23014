"""--device: Apple silicon's GPU (mps) where PyTorch has it, with the engine eager and in one process; on a machine
without it (or without CUDA, for cuda), and for a name that is no device, one error line before any model is read.
This machine has no Apple GPU: the accepted path runs with ``torch.backends.mps.is_available`` made to say yes, up to
the point where a tensor would have to go there."""

import pytest
import torch

from scalenlp.cli import main
from scalenlp.engine.config import EngineConfig
from scalenlp.engine.decoder_engine import pick_device
from scalenlp.engine.dtype import LayerShapes, choose_dtype
from scalenlp.engine.llm import engine_from_checkpoint
from scalenlp.errors import UserError

needs_no_mps = pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple GPU")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


def one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@needs_no_mps
@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["eval", "--data", "README.md"]])
def test_mps_is_refused_in_one_line_where_torch_has_none(tiny_export, capsys, command):
    assert main([command[0], "--checkpoint", str(tiny_export), "--device", "mps", *command[1:]]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "torch.backends.mps.is_available() is False" in err and "--device cpu" in err


@pytest.mark.parametrize("device, words", [
    pytest.param("cuda", "0 CUDA devices", marks=needs_no_cuda),
    pytest.param("cuda:0", "0 CUDA devices", marks=needs_no_cuda),
    ("gpu", "is not a device; use cpu, cuda, cuda:N or mps"),
    ("meta", "not meta"),
])
def test_other_devices_it_cannot_run_on_are_one_line(tmp_path, capsys, device, words):
    # The checkpoint does not exist: the device is refused before anything is read.
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", "--device", device]) == 2
    assert words in one_error_line(capsys.readouterr().err)


def test_mps_is_chosen_when_asked_for_and_present_never_by_default(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("mps") == torch.device("mps")
    assert pick_device("mps:0") == torch.device("mps", 0)
    assert pick_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("options, dropped", [({"compile": True}, "drop --compile"), ({"tp": 2}, "drop --tp")])
def test_the_engine_on_mps_is_eager_and_in_one_process(monkeypatch, tmp_path, options, dropped):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    config = EngineConfig(str(tmp_path / "none"), device="mps", **options)
    with pytest.raises(UserError, match=f"runs the engine eagerly in one process; {dropped}$"):
        engine_from_checkpoint(config)
    # Eager and alone, it goes on to read the checkpoint (which, here, is not there).
    with pytest.raises(UserError, match="does not exist"):
        engine_from_checkpoint(EngineConfig(str(tmp_path / "none"), device="mps"))


def test_auto_dtype_on_mps_is_float32_untimed():
    def measure(shapes):
        raise AssertionError("auto timed a layer for a device it does not measure")

    shapes = LayerShapes(dim=64, q_width=64, kv_width=32, ffn=128, gated=True, layers=2)
    choice = choose_dtype(torch.device("mps"), "auto", shapes, measure=measure)
    assert choice.dtype == torch.float32 and "not mps" in choice.reason
