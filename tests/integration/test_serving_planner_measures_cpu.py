"""`scalenlp plan --serve --device cpu` measures this machine (its communication figures with two gloo processes)
and plans on what it measured."""

import pytest

from scalenlp.cli import main


@pytest.mark.slow
def test_serving_on_this_cpu_is_measured(capsys):
    code = main(["plan", "--serve", "--model", "debug", "--device", "cpu", "--devices", "1", "--context", "128",
                 "--concurrency", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "#1 tp=1 replicas=1 (1 devices), batch 4" in out and "TTFT" in out and "KV cache" in out
