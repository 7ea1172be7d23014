"""A tensor-parallel rank that fails ends the run it belongs to: `generate --tp 2` exits with one line that names the
rank and its error, `serve --tp 2` answers the request in flight with a 503 and exits 1, and a follower process
that dies is reported to the engine, or ends rank 0 with one line while it loads."""

import subprocess
import sys

import httpx
import pytest

from scalenlp import faults
from train_helpers import HANG_GUARD_S, cli_env, error_lines


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_whose_forward_raises_ends_generate(tiny_export, rank):
    """The first decode step (forward 1, after the prefill) raises on one rank: the other ranks wait in a
    collective it never joins, yet every process ends, with one error line that names the rank and the error."""
    proc = subprocess.run([sys.executable, "-m", "scalenlp", "generate", "--checkpoint", str(tiny_export), "--tp", "2",
                           "--dtype", "float32", "--prompt", "hello", "--max-tokens", "4"],
                          env={**cli_env(), faults.ENV: f"raise@{rank}:1"}, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode != 0
    [line] = error_lines(proc.stderr)
    assert f"tensor-parallel rank {rank} failed: RuntimeError('{faults.ENV}: injected failure at step 1')" in line


@pytest.mark.slow
def test_a_follower_failing_under_serve_answers_the_request_in_flight_with_503(tiny_export):
    """Rank 1's first decode step raises while a request is in flight: that request gets a 503 that names the
    rank and its error (not a dropped connection), and the server exits 1 for its supervisor to restart it."""
    from infer_helpers import serve_process  # here: the follower process below imports this module without torch

    with serve_process(tiny_export, "--tp", "2", "--dtype", "float32", "--model-name", "m",
                       env={**cli_env(), faults.ENV: "raise@1:1"}) as (url, proc):
        r = httpx.post(url + "/v1/completions", timeout=HANG_GUARD_S,
                       json={"model": "m", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert "tensor-parallel rank 1 failed" in r.json()["error"]["message"]
        assert proc.wait(timeout=HANG_GUARD_S) == 1


def _exit_when_told(go, code: int) -> None:
    go.wait()
    sys.exit(code)


def test_a_follower_that_dies_is_reported_to_the_engine_with_its_exit_code():
    import multiprocessing
    import threading

    from scalenlp.engine.sharded import Followers

    ctx = multiprocessing.get_context("spawn")
    reports, _ = ctx.Pipe(duplex=False)
    go, told, done = ctx.Event(), [], threading.Event()
    follower = ctx.Process(target=_exit_when_told, args=(go, 3))
    follower.start()
    watched = Followers([follower], reports)
    watched.on_failure = lambda error: (told.append(error), done.set())
    go.set()  # only now: with no engine to tell, the watcher would end this process
    assert done.wait(HANG_GUARD_S)
    assert [str(e) for e in told] == ["tensor-parallel rank 1 died (exit code 3)"]


@pytest.mark.slow  # a new interpreter importing the engine (torch): 12-15 s here
def test_a_follower_that_dies_while_rank_0_loads_ends_rank_0_with_one_line():
    """No engine yet (rank 0 loading, or waiting for the others to join): nothing is in flight, rank 0 exits 1."""
    script = ("import multiprocessing, time, sys\n"
              "from scalenlp.engine.sharded import Followers\n"
              "if __name__ == '__main__':\n"
              "    ctx = multiprocessing.get_context('spawn')\n"
              "    p = ctx.Process(target=sys.exit, args=(3,)); p.start()\n"
              "    Followers([p], ctx.Pipe(duplex=False)[0])\n"
              "    time.sleep(3600)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 1
    assert error_lines(proc.stderr) == ["error: tensor-parallel rank 1 died (exit code 3); stopping"]
