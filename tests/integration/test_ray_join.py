"""`scalenlp serve --replicas N --ray-address ADDR` joins a Ray cluster that was started outside it
(here `ray start --head` on loopback, with token authentication as Ray 2.6x clusters have): the
replicas run on that cluster and answer requests; stopping the server takes its application down
and leaves the cluster running; without the cluster's token it fails with one clear error line.

Everything Ray runs in subprocesses: the cluster, the server (the CLI itself), and the checks that
connect to the cluster, so that no Ray state or authentication setting leaks into this process."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from scalenlp.parallel.mesh import free_port, free_ports
from scalenlp.serving.cluster import LOCAL_RAY_ENV

pytestmark = pytest.mark.slow  # multi-process runs of minutes: `make test-fast` leaves them out

pytest.importorskip("ray", reason="Ray Serve is an optional extra: pip install 'scalenlp[cluster]'")
BIN = Path(sys.executable).parent
PROMPTS = ["the quick brown fox", "hello", "a model that", "the lazy dog"]


def ray_env(**extra) -> dict:
    """A cluster on loopback only: Ray would otherwise rewrite 127.0.0.1 into the machine's outward
    address, on the head and in every process that connects to it."""
    return {**os.environ, **LOCAL_RAY_ENV, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", **extra}


def wait_for_line(log: Path, text: str, process: subprocess.Popen) -> None:
    while text not in log.read_text():
        assert process.poll() is None, f"exited with {process.returncode} before {text!r}:\n{log.read_text()}"
        time.sleep(0.5)


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process, then SIGKILL whatever of its process group is left (Ray's children)."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head started like an operator would, with its own token; every port chosen free and bound
    on 127.0.0.1. `--block` keeps it in the foreground, so the teardown stops this cluster only (`ray
    stop` would stop every Ray instance on the machine)."""
    work = tmp_path_factory.mktemp("join")
    env = ray_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    names = ("ray-client-server-port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port")
    port, *rest = free_ports(1 + len(names))
    ports = {f"--{name}": p for name, p in zip(names, rest)}
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    log = work / "head.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [BIN / "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
             *(f"{k}={v}" for k, v in ports.items())],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_line(log, "Ray runtime started", process)
        yield f"127.0.0.1:{port}", env, work
    finally:
        stop_group(process, grace_s=60)  # it drains for up to 30 s on SIGTERM
        shutil.rmtree(temp_dir, ignore_errors=True)


def on_cluster(address: str, env: dict, code: str):
    """Run ``code`` in a driver connected to the cluster; it sets ``result``, which comes back as JSON."""
    script = (f"import json, ray\nray.init(address={address!r}, logging_level='ERROR')\n{code}\n"
              "print('RESULT ' + json.dumps(result))")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(next(line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")))


LIST_CLUSTER = """
actors = ray.util.list_named_actors(all_namespaces=True)
result = {"replicas": sorted(a["name"].rsplit("#", 1)[-1] for a in actors if "#EngineReplica#" in a["name"]),
          "serve": any("SERVE_CONTROLLER" in a["name"] for a in actors),
          "cpus": ray.cluster_resources().get("CPU")}
"""


def serve_command(export: Path, address: str, port: int, replicas: int = 2) -> list:
    return [BIN / "scalenlp", "serve", "--checkpoint", str(export), "--replicas", str(replicas), "--replica-cpus", "0.5",
            "--ray-address", address, "--port", str(port), "--dtype", "float32", "--device", "cpu",
            "--max-batch", "2", "--model-name", "m"]


def test_serve_joins_a_cluster_and_leaves_it_running(head, tiny_export):
    address, env, work = head
    port = free_port()
    log = work / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(serve_command(tiny_export, address, port), env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_line(log, "serving 2 replica(s) at", server)
        on = on_cluster(address, env, LIST_CLUSTER)
        assert len(on["replicas"]) == 2 and on["serve"]

        results = [None] * (2 * len(PROMPTS))

        def post(i):
            body = {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            results[i] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        assert {r.json()["system_fingerprint"] for r in results} == set(on["replicas"])  # the cluster's replicas
        texts = [r.json()["choices"][0]["text"] for r in results]
        assert texts[:len(PROMPTS)] == texts[len(PROMPTS):]  # greedy: the same text whichever replica served it
    finally:
        server.terminate()  # SIGTERM, as a service manager stops it
        server.wait()
    assert server.returncode == 0, log.read_text()
    after = on_cluster(address, env, LIST_CLUSTER)
    # The cluster still runs with all its CPUs; our application and the Serve instance we started are gone.
    assert after == {"replicas": [], "serve": False, "cpus": 2.0}


def test_joining_without_the_token_is_one_clear_error(head, tiny_export):
    address, env, _ = head
    # Ray retries a refused connection for 60 s before it gives up (gcs_rpc_server_reconnect_timeout_s); 5 s
    # shows the same refusal.
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"} | {"RAY_AUTH_MODE": "disabled",
                                                                          "RAY_gcs_rpc_server_reconnect_timeout_s": "5"}
    out = subprocess.run(serve_command(tiny_export, address, free_port()), env=no_token, capture_output=True, text=True)
    assert out.returncode == 2
    assert f"error: cannot join the Ray cluster at {address}" in out.stderr and "RAY_AUTH_MODE=token" in out.stderr


OPERATOR_SERVE = """
from ray import serve
serve.start(http_options={{"host": "127.0.0.1", "port": {port}}})

@serve.deployment(ray_actor_options={{"num_cpus": 0}})
class Other:
    async def __call__(self, request):
        return "other"

serve.run(Other.bind(), name="other", route_prefix="/other")
result = True
"""

SERVE_APPS = "from ray import serve\nresult = sorted(serve.status().applications)"


def test_joining_a_running_serve_uses_its_address_and_leaves_its_apps(head, tiny_export):
    address, env, work = head
    theirs = free_port()
    on_cluster(address, env, OPERATOR_SERVE.format(port=theirs))  # an operator's Serve, with an application
    log = work / "serve2.log"
    try:
        with open(log, "w") as out:
            server = subprocess.Popen(serve_command(tiny_export, address, free_port(), replicas=1), env=env,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:  # one replica: what is checked here is where Serve listens and which applications stay
            wait_for_line(log, "serving 1 replica(s) at", server)
            assert f"serving 1 replica(s) at http://127.0.0.1:{theirs} " in log.read_text()
            assert "--host and --port apply only where scalenlp starts Serve" in log.read_text()
            body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 4}
            assert httpx.post(f"http://127.0.0.1:{theirs}/v1/completions", json=body, timeout=600).status_code == 200
        finally:
            server.terminate()
            server.wait()
        assert server.returncode == 0, log.read_text()
        assert on_cluster(address, env, SERVE_APPS) == ["other"]  # ours is gone, the operator's and Serve remain
        assert httpx.get(f"http://127.0.0.1:{theirs}/other", timeout=60).text == "other"
    finally:
        on_cluster(address, env, "from ray import serve\nserve.shutdown()\nresult = True")
