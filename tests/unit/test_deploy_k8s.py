"""`scalenlp deploy k8s`: every manifest valid against the Kubernetes schemas (offline: kubernetes-validate for
core kinds, the JobSet API's published schema for the JobSet), commands the real parser accepts."""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from scalenlp.cli import build_parser, main
from scalenlp.cli.deploy import IMAGE_USER, RDZV_PORT
from scalenlp.config import load_config

K8S_VERSION = "1.35"  # the Kubernetes release the JobSet schema's references name (v1.35.3)
DATA = Path(__file__).resolve().parents[1] / "data"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"


@pytest.fixture(scope="module")
def jobset_schema() -> jsonschema.Draft202012Validator:
    """The JobSet API's definitions, their Kubernetes references resolved to kubernetes-validate's strict schemas
    of the same release, and made strict themselves (no field outside the schema, as kubectl --validate=strict)."""
    swagger = (DATA / "jobset_v1alpha2_swagger.json").read_text()
    swagger = swagger.replace("https://raw.githubusercontent.com/kubernetes/kubernetes/refs/tags/v1.35.3/api/"
                              "openapi-spec/swagger.json#/definitions/", f"{K8S_DEFS}#/$defs/")
    definitions = json.loads(swagger.replace("#/definitions/", "#/$defs/"))["definitions"]
    for definition in definitions.values():
        definition["additionalProperties"] = False
    k8s = json.loads(files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict/_definitions.json").read_text())
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://scalenlp.invalid/jobset",
              "$defs": definitions, "$ref": "#/$defs/jobset.v1alpha2.JobSet"}
    return jsonschema.Draft202012Validator(schema, registry=Registry().with_resource(
        K8S_DEFS, Resource.from_contents(k8s)))


def validate(obj: dict, jobset_schema) -> None:
    if obj["kind"] == "JobSet":
        assert obj["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        jobset_schema.validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def deploy(out: Path, *args: str) -> dict[str, dict]:
    assert main(["deploy", "k8s", "--image", "registry.example/scalenlp:0.1", "--out", str(out), *args]) == 0
    return {p.name: yaml.safe_load(p.read_text()) for p in out.iterdir()}


def pod_spec(obj: dict) -> dict:
    template = obj["spec"]["replicatedJobs"][0]["template"]["spec"] if obj["kind"] == "JobSet" else obj["spec"]
    return template["template"]


def test_schemas_refuse_what_kubernetes_refuses(jobset_schema, tmp_path):
    """The validation has teeth: a misspelled field, deep in a JobSet's pod template or in a Deployment, fails."""
    manifests = {**deploy(tmp_path / "t", "--train", str(CONFIGS / "debug.toml")),
                 **deploy(tmp_path / "s", "--serve", "/models/m")}
    for file, path in (("jobset.yaml", ["spec", "network"]), ("jobset.yaml", None), ("deployment.yaml", None)):
        broken = copy.deepcopy(manifests[file])
        if path is None:  # the container, where most mistakes land
            pod_spec(broken)["spec"]["containers"][0]["imagePullPolicy "] = "Always"
        else:
            broken["spec"]["network"]["enableDNSHostname"] = True
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(broken, jobset_schema)


def test_training_job_on_two_nodes(jobset_schema, tmp_path):
    got = deploy(tmp_path / "k8s", "--train", str(CONFIGS / "debug.toml"), "--name", "llm", "--nodes", "2",
                 "--gpus-per-node", "4", "--memory-per-node", "64Gi", "--max-restarts", "2",
                 "--set", "training.global_batch_size=16", "--storage-class", "nfs", "--namespace", "ml")
    assert sorted(got) == ["configmap.yaml", "jobset.yaml", "pvc.yaml", "service.yaml"]
    for obj in got.values():
        validate(obj, jobset_schema)
        assert obj["metadata"]["namespace"] == "ml"
    jobset, service, pvc = got["jobset.yaml"], got["service.yaml"], got["pvc.yaml"]
    job = jobset["spec"]["replicatedJobs"][0]
    assert job["template"]["spec"]["completions"] == job["template"]["spec"]["parallelism"] == 2
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 2
    pod = job["template"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"memory": "64Gi"}, "limits": {"nvidia.com/gpu": 4}}

    # The command is one `scalenlp train` accepts, and its pieces point at the other objects.
    assert container["command"][0] == "scalenlp"
    args = build_parser().parse_args(container["command"][1:])
    assert (args.command, args.nproc, args.nnodes, args.max_restarts) == ("train", 4, "2", 2)
    host, port = args.rdzv_endpoint.split(":")
    # JobSet's pod hostnames: <jobset>-<replicated job>-<job index>-<pod index>, under the jobset's subdomain.
    assert host == f"llm-{job['name']}-0-0.{jobset['spec']['network']['subdomain']}" and int(port) == RDZV_PORT
    assert service["metadata"]["name"] == "llm" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] and RDZV_PORT in [p["port"] for p in service["spec"]["ports"]]
    assert service["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": "llm"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert args.run_dir.startswith(mounts["runs"] + "/")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    config_map = got["configmap.yaml"]
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert args.config == mounts["config"] + "/" + next(iter(config_map["data"]))

    # The config the pods read: the user's, with their overrides, resuming after a restart.
    (tmp_path / "train.toml").write_text(config_map["data"]["train.toml"])
    cfg = load_config(tmp_path / "train.toml")
    expected = load_config(CONFIGS / "debug.toml", ["training.global_batch_size=16", "checkpoint.resume=true"])
    assert cfg == expected
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    assert {"name": "metrics", "containerPort": args.metrics_port} in container["ports"]
    assert args.metrics_host == "0.0.0.0"  # Prometheus scrapes the pod's address; the trainer's default is loopback


def test_one_node_needs_no_rendezvous_endpoint(jobset_schema, tmp_path):
    got = deploy(tmp_path / "k8s", "--train", str(CONFIGS / "debug.toml"))
    for obj in got.values():
        validate(obj, jobset_schema)
    args = build_parser().parse_args(pod_spec(got["jobset.yaml"])["spec"]["containers"][0]["command"][1:])
    assert (args.nnodes, args.nproc, args.rdzv_endpoint) == ("1", 1, "")
    assert got["jobset.yaml"]["metadata"]["name"] == "debug"  # from the config's file name
    assert deploy(tmp_path / "s", "--serve", "/runs/My_Run/export")["service.yaml"]["metadata"]["name"] == "my-run"
    assert got["pvc.yaml"]["spec"]["accessModes"] == ["ReadWriteOnce"]


@pytest.mark.parametrize("what, gpus, image", [("--train", "0", "scalenlp:cpu"), ("--train", "2", "scalenlp:cuda"),
                                               ("--serve", "0", "scalenlp:cpu"), ("--serve", "1", "scalenlp:cuda")])
def test_without_image_the_projects_own_and_its_user_writes_the_checkpoints(jobset_schema, tmp_path, capsys, what,
                                                                               gpus, image):
    """docker/Dockerfile's tag, or docker/Dockerfile.cuda's on GPUs (test_container_image checks the user id)."""
    target = str(CONFIGS / "debug.toml") if what == "--train" else "/models/m"
    assert main(["deploy", "k8s", "--out", str(tmp_path), what, target, "--gpus-per-node", gpus]) == 0
    assert f"(image {image})" in capsys.readouterr().out
    got = {p.name: yaml.safe_load(p.read_text()) for p in tmp_path.iterdir()}
    pod = pod_spec(got["jobset.yaml" if what == "--train" else "deployment.yaml"])
    assert pod["spec"]["containers"][0]["image"] == image
    if what == "--train":  # the image's user is not root: the checkpoint volume is its group's
        assert pod["spec"]["securityContext"]["fsGroup"] == IMAGE_USER
    for obj in got.values():
        validate(obj, jobset_schema)


def test_server_replicas_with_probes_and_prometheus(jobset_schema, tmp_path):
    got = deploy(tmp_path / "k8s", "--serve", "/checkpoints/llm/export", "--name", "chat", "--replicas", "3",
                 "--gpus-per-node", "1", "--volume-claim", "llm-checkpoints", "--api-key-secret", "chat-key")
    assert sorted(got) == ["deployment.yaml", "service.yaml"]
    for obj in got.values():
        validate(obj, jobset_schema)
    deployment, service = got["deployment.yaml"], got["service.yaml"]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = build_parser().parse_args(container["command"][1:])
    assert (args.command, args.checkpoint, args.host) == ("serve", "/checkpoints/llm/export", "0.0.0.0")
    assert {"name": "http", "containerPort": args.port} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": str(args.port),
                                              "prometheus.io/path": "/metrics"}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
    assert container["env"][0]["name"] == "SCALENLP_API_KEY"  # what `scalenlp serve` reads
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "llm-checkpoints", "readOnly": True}


@pytest.mark.parametrize("args, message", [
    (["--serve", "/m", "--nodes", "2"], "error: --nodes apply to --train; remove them"),
    (["--train", "CFG", "--replicas", "2"], "error: --replicas apply to --serve; remove them"),
    (["--serve", "/m", "--name", "Chat_1"], "error: --name 'Chat_1' is not a Kubernetes name"),
    (["--train", "CFG", "--memory-per-node", "64GB"], "error: --memory-per-node '64GB' is not a Kubernetes quantity"),
    # Values written into the manifests verbatim: refused here rather than by the API server (or, with a newline,
    # by a YAML that now says something else).
    (["--train", "CFG", "--cpus-per-node", "\u0663"], "error: --cpus-per-node '\u0663' is not a Kubernetes quantity"),
    (["--train", "CFG", "--checkpoint-volume", "\uff11\uff10Gi"], "error: --checkpoint-volume '\uff11\uff10Gi' is not"),
    (["--serve", "/m", "--namespace", "prod\nkind: Secret"], "error: --namespace 'prod\\nkind: Secret' is not a"),
    (["--serve", "/m", "--namespace", "Prod"], "error: --namespace 'Prod' is not a Kubernetes namespace"),
    (["--serve", "/m", "--volume-claim", "runs\n"], "error: --volume-claim 'runs\\n' is not a Kubernetes object"),
    (["--serve", "/m", "--api-key-secret", "api_key"], "error: --api-key-secret 'api_key' is not a Kubernetes"),
    (["--train", "CFG", "--storage-class", "fast ssd"], "error: --storage-class 'fast ssd' is not a Kubernetes"),
    (["--serve", "/m", "--image", "img\ncommand: [sh]"], "error: --image 'img\\ncommand: [sh]' is not a container"),
    (["--serve", "/m", "--image", "Registry.example/Team/img"], "error: --image 'Registry.example/Team/img' is not"),
    (["--train", "CFG", "--nodes", "0"], "error: --nodes must be at least 1, got 0"),
    (["--train", "CFG", "--set", "training.steps=0"], "error: training.steps must be at least 1, got 0"),
    (["--train", "CFG", "--nodes", "3", "--set", "training.global_batch_size=4"],
     "error: training.global_batch_size=4 is not divisible by the 3 data-parallel ranks"),
])
def test_mistakes_are_one_error_line_and_write_nothing(tmp_path, capsys, args, message):
    args = [str(CONFIGS / "debug.toml") if a == "CFG" else a for a in args]
    out = tmp_path / "k8s"
    image = [] if "--image" in args else ["--image", "i"]
    assert main(["deploy", "k8s", *image, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not out.exists()


def test_existing_manifests_are_not_overwritten(tmp_path, capsys):
    out = tmp_path / "k8s"
    deploy(out, "--serve", "/m")
    before = (out / "service.yaml").read_text()
    assert main(["deploy", "k8s", "--image", "other", "--out", str(out), "--serve", "/m"]) == 2
    assert "already has deployment.yaml, service.yaml" in capsys.readouterr().err
    assert (out / "service.yaml").read_text() == before
