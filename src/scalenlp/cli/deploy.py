"""`scalenlp deploy k8s`: Kubernetes manifests for a training job or a server, one YAML file per object;
`scalenlp deploy slurm`: an sbatch script for a training job.

Training (--train CONFIG): a JobSet (jobset.x-k8s.io/v1alpha2, the Kubernetes SIG's API for jobs of
several pods) of one Indexed Job with a pod per node, each pod running `scalenlp train` (torchrun inside),
with torchrun's c10d rendezvous on pod 0 found through a headless Service; the config, resolved and
checked here, in a ConfigMap; a ReadWriteMany PersistentVolumeClaim for the run folder, since every
node's ranks write their checkpoint shards into one folder. Failures: torchrun restarts a pod's workers
up to --max-restarts times (a crashed rank); a pod that fails (its node lost) makes the JobSet recreate
every pod, up to --max-restarts times. Either way training continues from the newest checkpoint, as the
config carries checkpoint.resume=true. SIGTERM (preemption, `kubectl delete`) saves a checkpoint before
the workers exit; --grace-period is the time Kubernetes leaves them for it.

The image (--image) is by default the project's own, docker/Dockerfile's (``scalenlp:cpu``) or, with GPUs,
docker/Dockerfile.cuda's (``scalenlp:cuda``), under the tags the README builds them as: a cluster pulls them once
they are pushed to its registry and named with --image. Their user is not root (uid and gid ``IMAGE_USER``): the
training pods give that group the checkpoint volume (fsGroup) so that it can write there.

Serving (--serve CHECKPOINT): a Deployment of --replicas pods, each running `scalenlp serve`, with startup,
readiness and liveness probes on /health and Prometheus' scrape annotations on /metrics, behind a Service
that spreads requests over the ready replicas.

Slurm (--train CONFIG): an sbatch script of one srun task per node, each running `scalenlp train` with no
launch flags: the allocation gives them (scalenlp.launch_env), torchrun's c10d rendezvous meeting on the
first node. The config, resolved and checked here, is written beside the script with checkpoint.resume=true,
so that a requeued job (--requeue: a node failed) resumes from the newest checkpoint; --signal sends SIGTERM
--grace-period seconds before the time limit, and every rank saves a checkpoint and exits.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from scalenlp.config import config_toml
from scalenlp.errors import UserError, require

RDZV_PORT = 29400  # torchrun's default c10d rendezvous port
SERVE_PORT = 8000  # `scalenlp serve`'s default port
# What `docker build` tags docker/Dockerfile and docker/Dockerfile.cuda as (README, "A container image").
DEFAULT_IMAGES = {"cpu": "scalenlp:cpu", "cuda": "scalenlp:cuda"}
IMAGE_USER = 10001  # the images' user id and group id (docker/Dockerfile's useradd)
CONFIG_DIR = "/etc/scalenlp"
RUNS_DIR = "/checkpoints"  # where the checkpoint volume is mounted
# The server loads the model before it answers /health: up to STARTUP_CHECKS * PROBE_PERIOD_S seconds.
PROBE_PERIOD_S, STARTUP_CHECKS = 10, 60
NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
# Pod hostnames <name>-node-<job>-<index> must stay within DNS's 63 characters.
MAX_NAME = 50
QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([numkMGTPE]|[KMGTPE]i)?", re.ASCII)  # ASCII: not '٣Gi'
# What the API server takes as names: namespaces are DNS labels (RFC 1123), claims, Secrets and storage classes
# DNS subdomains.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# A container image reference, [REGISTRY[:PORT]/]PATH[:TAG][@DIGEST], as the distribution project's grammar has it.
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(rf"(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_PATH}(?:/{_PATH})*(?::\w[\w.-]{{0,127}})?"
                   rf"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{{32,}})?", re.ASCII)

# Options that apply to one kind of manifest, with their defaults (given with the other kind: an error).
TRAIN_ONLY = {"overrides": [], "nodes": 1, "nproc_per_node": None, "checkpoint_volume": "100Gi",
              "storage_class": None, "max_restarts": 3, "metrics_port": 9400, "grace_period": 300}
SERVE_ONLY = {"replicas": 1, "volume_claim": None, "api_key_secret": None}


SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}", re.ASCII)  # sbatch --time: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]
SLURM_WORD = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)  # a partition, account or job name: nothing the shell reads
SLURM_MEMORY = re.compile(r"\d+[KMGT]?", re.ASCII)


def add_arguments(p: argparse.ArgumentParser) -> None:
    targets = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    _add_slurm(targets)
    k = targets.add_parser("k8s", help="Kubernetes: a JobSet for training, a Deployment for serving",
                           description="Write Kubernetes manifests to --out; `kubectl apply -f DIR` runs them.")
    what = k.add_mutually_exclusive_group(required=True)
    what.add_argument("--train", metavar="CONFIG", help="training job of this TOML config (checked here)")
    what.add_argument("--serve", metavar="CHECKPOINT", help="server of this checkpoint: its path inside the "
                                                            "container (in the image, or on --volume-claim)")
    k.add_argument("--image", help=f"container image with scalenlp installed (default: {DEFAULT_IMAGES['cpu']}, "
                                   f"docker/Dockerfile's, or with --gpus-per-node {DEFAULT_IMAGES['cuda']}, "
                                   f"docker/Dockerfile.cuda's: push it to the cluster's registry and name it here)")
    k.add_argument("--out", required=True, metavar="DIR", help="folder for the YAML files")
    k.add_argument("--name", help="name of the job or server, prefix of its objects (default: from the config's "
                                  "or the checkpoint's file name)")
    k.add_argument("--namespace", help="namespace of every object (default: kubectl's current one)")
    k.add_argument("--gpus-per-node", type=int, default=0, help="GPUs of each pod (a node or a server replica)")
    k.add_argument("--cpus-per-node", metavar="QUANTITY", help="CPU request of each pod, e.g. 8 or 500m")
    k.add_argument("--memory-per-node", metavar="QUANTITY", help="memory request of each pod, e.g. 64Gi")
    train = k.add_argument_group("training")
    train.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                       help="override one config key, as for scalenlp train; repeatable")
    train.add_argument("--nodes", type=int, default=TRAIN_ONLY["nodes"], help="pods, one per machine")
    train.add_argument("--nproc-per-node", type=int, help="training processes per pod (default: --gpus-per-node, "
                                                          "or 1 without GPUs)")
    train.add_argument("--checkpoint-volume", default=TRAIN_ONLY["checkpoint_volume"], metavar="SIZE",
                       help="size of the run folder's volume (default %(default)s)")
    train.add_argument("--storage-class", help="storage class of that volume; it must offer ReadWriteMany "
                                               "(NFS, CephFS, a cloud file store) when --nodes > 1")
    train.add_argument("--max-restarts", type=int, default=TRAIN_ONLY["max_restarts"],
                       help="torchrun's restarts of a pod's workers, and the JobSet's restarts of all pods "
                            "(default %(default)s)")
    train.add_argument("--metrics-port", type=int, default=TRAIN_ONLY["metrics_port"],
                       help="scalenlp train --metrics-port, annotated for Prometheus (default %(default)s)")
    train.add_argument("--grace-period", type=int, default=TRAIN_ONLY["grace_period"], metavar="SECONDS",
                       help="from SIGTERM to SIGKILL: time to save a checkpoint (default %(default)s)")
    serve = k.add_argument_group("serving")
    serve.add_argument("--replicas", type=int, default=SERVE_ONLY["replicas"], help="server pods (default 1)")
    serve.add_argument("--volume-claim", metavar="CLAIM", help=f"PersistentVolumeClaim mounted read-only at "
                                                               f"{RUNS_DIR}, e.g. a training job's NAME-checkpoints")
    serve.add_argument("--api-key-secret", metavar="SECRET",
                       help="Secret whose key `api-key` the servers require as bearer token (/health stays open; "
                            "Prometheus then needs the key for /metrics)")


def _add_slurm(targets) -> None:
    s = targets.add_parser("slurm", help="Slurm: an sbatch script for training",
                           description="Write an sbatch script and its config to --out; `sbatch OUT/train.sbatch` "
                                       "runs it. --out and --run-dir must be on storage every node mounts.")
    s.add_argument("--train", metavar="CONFIG", required=True, help="TOML config of the job (checked here)")
    s.add_argument("--out", required=True, metavar="DIR", help="folder for the script, its config and the job's log")
    s.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override one config key, as for scalenlp train; repeatable")
    s.add_argument("--run-dir", metavar="DIR", help="the job's run folder (default: runs/NAME from here)")
    s.add_argument("--name", help="job name (default: from the config's file name)")
    s.add_argument("--nodes", type=int, default=1, help="machines, one srun task each (default 1)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs of each node's task, one process each")
    s.add_argument("--nproc-per-node", type=int, help="training processes per node (default: --gpus-per-node, "
                                                      "or 1 without GPUs)")
    s.add_argument("--cpus-per-node", type=int, help="CPUs of each node's task")
    s.add_argument("--memory-per-node", metavar="SIZE", help="memory of each node, as sbatch --mem takes it: 64G")
    s.add_argument("--time", metavar="LIMIT", help="time limit, as sbatch --time takes it: 2-00:00:00, 90")
    s.add_argument("--partition", help="partition to run in (default: the cluster's default)")
    s.add_argument("--account", help="account to charge (default: yours)")
    s.add_argument("--max-restarts", type=int, default=3,
                   help="torchrun's restarts of a node's workers when one fails (default %(default)s)")
    s.add_argument("--grace-period", type=int, default=300, metavar="SECONDS",
                   help="SIGTERM this long before the time limit: time to save a checkpoint (default %(default)s)")


def _check(args: argparse.Namespace) -> None:
    mine, other = (TRAIN_ONLY, SERVE_ONLY) if args.train else (SERVE_ONLY, TRAIN_ONLY)
    given = [name for name, default in other.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + ("set" if name == "overrides" else name.replace("_", "-")) for name in given)
        raise UserError(f"{flags} apply to {'--serve' if args.train else '--train'}; remove them")
    if args.name is not None and not (NAME.fullmatch(args.name) and len(args.name) <= MAX_NAME):
        raise UserError(f"--name {args.name!r} is not a Kubernetes name: lower-case letters, digits and '-', "
                        f"starting with a letter, at most {MAX_NAME} characters")
    if args.namespace is not None and not (DNS_LABEL.fullmatch(args.namespace) and len(args.namespace) <= 63):
        raise UserError(f"--namespace {args.namespace!r} is not a Kubernetes namespace: lower-case letters, digits "
                        f"and '-', starting and ending with a letter or digit, at most 63 characters")
    for option in ("volume_claim", "api_key_secret", "storage_class"):
        value = getattr(args, option)
        if value is not None and not (DNS_SUBDOMAIN.fullmatch(value) and len(value) <= 253):
            raise UserError(f"--{option.replace('_', '-')} {value!r} is not a Kubernetes object name: lower-case "
                            f"letters, digits, '-' and '.', starting and ending with a letter or digit")
    if not (IMAGE.fullmatch(args.image) and len(args.image) <= 4096):
        raise UserError(f"--image {args.image!r} is not a container image reference such as "
                        f"registry.example.com/team/scalenlp:1.0 ([REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], the name "
                        f"in lower case)")
    for option in ("gpus_per_node", "max_restarts", "grace_period"):
        if getattr(args, option) < 0:
            raise UserError(f"--{option.replace('_', '-')} must be at least 0, got {getattr(args, option)}")
    for option in ("nodes", "replicas", "nproc_per_node"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UserError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    if not 1 <= args.metrics_port <= 65535:
        raise UserError(f"--metrics-port must be between 1 and 65535, got {args.metrics_port}")
    for option in ("cpus_per_node", "memory_per_node", "checkpoint_volume"):
        value = getattr(args, option)
        if value is not None and not QUANTITY.fullmatch(value):
            raise UserError(f"--{option.replace('_', '-')} {value!r} is not a Kubernetes quantity such as 8, 500m "
                            f"or 64Gi")


def default_name(path: str) -> str:
    """A Kubernetes name from a file or folder name: runs/My_Model.toml -> my-model."""
    stem = Path(path.rstrip("/")).stem.lower()
    name = re.sub(r"[^a-z0-9]+", "-", stem).strip("-")
    if not name or not name[0].isalpha():
        name = f"scalenlp-{name}".rstrip("-")
    return name[:MAX_NAME].rstrip("-")


def _metadata(name: str, args: argparse.Namespace, labels: dict[str, str]) -> dict:
    meta = {"name": name, "labels": labels}
    if args.namespace:
        meta["namespace"] = args.namespace
    return meta


def _resources(args: argparse.Namespace) -> dict:
    requests = {key: value for key, value in (("cpu", args.cpus_per_node), ("memory", args.memory_per_node))
                if value is not None}
    resources = {"requests": requests} if requests else {}
    if args.gpus_per_node:  # an extended resource: its request is its limit
        resources["limits"] = {"nvidia.com/gpu": args.gpus_per_node}
    return resources


def _scrape(port: int) -> dict[str, str]:
    """The annotations Prometheus' Kubernetes service discovery reads by convention."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def training_config(args: argparse.Namespace):
    """(the job's config, checked for its world size, with checkpoint.resume=true: a restarted job continues
    the run; its processes per node)."""
    from scalenlp.train.tasks import load_config  # torch: only for a training job

    cfg = load_config(args.train, args.overrides)
    cfg.checkpoint.resume = True
    nproc = args.nproc_per_node or args.gpus_per_node or 1
    if not cfg.model.init or Path(cfg.model.init).exists():  # else the checkpoint is only on the cluster
        from scalenlp.train.trainer import validate_run

        validate_run(cfg, args.nodes * nproc)
    return cfg, nproc


def training_manifests(args: argparse.Namespace) -> dict[str, dict]:
    """{file name: object} of a training job."""
    cfg, nproc = training_config(args)
    name = args.name or default_name(args.train)
    labels = {"app.kubernetes.io/name": "scalenlp", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/component": "train"}
    command = ["scalenlp", "train", "--config", f"{CONFIG_DIR}/train.toml", "--run-dir", f"{RUNS_DIR}/{name}",
               "--nproc", str(nproc), "--nnodes", str(args.nodes), "--max-restarts", str(args.max_restarts),
               # Prometheus scrapes the pod's address, not its loopback; the pod network is the boundary.
               "--metrics-port", str(args.metrics_port), "--metrics-host", "0.0.0.0"]
    if args.nodes > 1:
        # JobSet names pods <jobset>-<replicated job>-<job index>-<pod index>, under the subdomain <jobset>.
        command += ["--rdzv-endpoint", f"{name}-node-0-0.{name}:{RDZV_PORT}", "--rdzv-id", name]
    claim, config_map = f"{name}-checkpoints", f"{name}-config"
    container = {
        "name": "train", "image": args.image, "command": command,
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],  # log lines reach `kubectl logs` as they happen
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT}, {"name": "metrics", "containerPort": args.metrics_port}],
        "resources": _resources(args),
        "volumeMounts": [{"name": "runs", "mountPath": RUNS_DIR}, {"name": "config", "mountPath": CONFIG_DIR},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {
        "metadata": {"labels": labels, "annotations": _scrape(args.metrics_port)},
        "spec": {
            "restartPolicy": "Never",  # a failed pod fails its Job, and the JobSet recreates them all
            # The volume's files belong to the image's group, which its user (not root) writes checkpoints as;
            # their ownership is changed only when the volume's top folder has another group (a large volume's
            # recursive change would slow every start).
            "securityContext": {"fsGroup": IMAGE_USER, "fsGroupChangePolicy": "OnRootMismatch"},
            "terminationGracePeriodSeconds": args.grace_period,
            "containers": [container],
            "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": claim}},
                        {"name": "config", "configMap": {"name": config_map}},
                        # NCCL and the data loaders share memory through /dev/shm, 64 MiB by default in a pod.
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        },
    }
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(name, args, labels),
        "spec": {
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {
                "completionMode": "Indexed", "parallelism": args.nodes, "completions": args.nodes,
                "backoffLimit": 0, "template": pod}}}],
        },
    }
    service = {  # headless: a DNS name per pod, reachable before the pod is ready (the rendezvous comes first)
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(name, args, labels),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"jobset.sigs.k8s.io/jobset-name": name},
                 "ports": [{"name": "rdzv", "port": RDZV_PORT}, {"name": "metrics", "port": args.metrics_port}]},
    }
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _metadata(claim, args, labels),
        "spec": {"accessModes": ["ReadWriteMany" if args.nodes > 1 else "ReadWriteOnce"],
                 "resources": {"requests": {"storage": args.checkpoint_volume}}},
    }
    if args.storage_class:
        pvc["spec"]["storageClassName"] = args.storage_class
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(config_map, args, labels),
              "data": {"train.toml": config_toml(cfg)}}
    return {"pvc.yaml": pvc, "configmap.yaml": config, "service.yaml": service, "jobset.yaml": jobset}


def serving_manifests(args: argparse.Namespace) -> dict[str, dict]:
    """{file name: object} of a server."""
    served = Path(args.serve)
    # <run_dir>/export and <run_dir>/best (the trainer's) are named after their run.
    name = args.name or default_name(str(served.parent if served.name in ("export", "best") else served))
    labels = {"app.kubernetes.io/name": "scalenlp", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/component": "serve"}
    health = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S}
    container = {
        "name": "serve", "image": args.image,
        "command": ["scalenlp", "serve", "--checkpoint", args.serve, "--host", "0.0.0.0", "--port", str(SERVE_PORT)],
        "ports": [{"name": "http", "containerPort": SERVE_PORT}],
        "startupProbe": {**health, "failureThreshold": STARTUP_CHECKS},
        "readinessProbe": {**health, "failureThreshold": 1},  # out of the Service at once when it stops answering
        "livenessProbe": {**health, "failureThreshold": 3},  # restarted when it stays dead
        "resources": _resources(args),
    }
    volumes = []
    if args.volume_claim:
        container["volumeMounts"] = [{"name": "runs", "mountPath": RUNS_DIR, "readOnly": True}]
        volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": args.volume_claim, "readOnly": True}}]
    if args.api_key_secret:  # `scalenlp serve` reads SCALENLP_API_KEY; the key stays out of the manifests
        container["env"] = [{"name": "SCALENLP_API_KEY",
                             "valueFrom": {"secretKeyRef": {"name": args.api_key_secret, "key": "api-key"}}}]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(name, args, labels),
        "spec": {"replicas": args.replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels, "annotations": _scrape(SERVE_PORT)},
                              "spec": {"containers": [container], **({"volumes": volumes} if volumes else {})}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(name, args, labels),
               "spec": {"selector": labels, "ports": [{"name": "http", "port": SERVE_PORT, "targetPort": "http"}]}}
    return {"deployment.yaml": deployment, "service.yaml": service}


def _check_slurm(args: argparse.Namespace) -> None:
    for option in ("nodes", "nproc_per_node", "cpus_per_node"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UserError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    for option in ("gpus_per_node", "max_restarts", "grace_period"):
        if getattr(args, option) < 0:
            raise UserError(f"--{option.replace('_', '-')} must be at least 0, got {getattr(args, option)}")
    if args.gpus_per_node and args.nproc_per_node not in (None, args.gpus_per_node):
        raise UserError(f"--nproc-per-node {args.nproc_per_node} with --gpus-per-node {args.gpus_per_node}: each "
                        f"process takes one GPU; drop --nproc-per-node")
    for option, pattern, example in (("name", SLURM_WORD, "llm-pretrain"), ("partition", SLURM_WORD, "gpu"),
                                     ("account", SLURM_WORD, "nlp-lab"), ("time", SLURM_TIME, "2-00:00:00 or 90"),
                                     ("memory_per_node", SLURM_MEMORY, "64G")):
        value = getattr(args, option)
        if value is not None and not pattern.fullmatch(value):
            raise UserError(f"--{option.replace('_', '-')} {value!r} is not what sbatch takes, such as {example}")


def slurm_script(args: argparse.Namespace) -> dict[str, str]:
    """{file name: text} of a Slurm training job: the sbatch script and its config."""
    cfg, nproc = training_config(args)
    name = args.name or default_name(args.train)
    out = Path(args.out).resolve()
    run_dir = Path(args.run_dir or Path("runs") / name).resolve()
    options = [("job-name", name, None), ("nodes", args.nodes, None),
               ("ntasks-per-node", 1, "one task per node: torchrun's launcher of its processes"),
               ("gpus-per-task", args.gpus_per_node or None, None), ("cpus-per-task", args.cpus_per_node, None),
               ("mem", args.memory_per_node, None), ("time", args.time, None), ("partition", args.partition, None),
               ("account", args.account, None), ("output", shlex.quote(str(out / f"{name}-%j.log")), None),
               ("open-mode", "append", "a requeued job's log goes on after its earlier attempt's"),
               ("requeue", "", "a failed node requeues the job: it resumes from the newest checkpoint"),
               ("signal", f"TERM@{args.grace_period}", f"SIGTERM {args.grace_period} s before the time limit: every "
                                                       f"rank saves a checkpoint and exits")]
    lines = ["#!/bin/bash",
             f"# scalenlp deploy slurm: {args.nodes} node(s) x {nproc} training process(es); run with: "
             f"sbatch {out / 'train.sbatch'}"]
    for option, value, why in options:
        if value is None:
            continue
        lines += [f"# {why}"] * bool(why) + [f"#SBATCH --{option}" + (f"={value}" if value != "" else "")]
    # The tasks read the allocation (nodes, the first node as rendezvous, GPUs per task) from Slurm's variables.
    command = ["srun", "--kill-on-bad-exit=1", "scalenlp", "train", "--config", shlex.quote(str(out / "train.toml")),
               "--run-dir", shlex.quote(str(run_dir)), "--max-restarts", str(args.max_restarts)]
    if not args.gpus_per_node and nproc > 1:  # without GPUs per task, the processes per node are not implied
        command += ["--nproc", str(nproc)]
    lines += ["export PYTHONUNBUFFERED=1  # log lines reach the job's log as they happen", " ".join(command), ""]
    return {"train.sbatch": "\n".join(lines), "train.toml": config_toml(cfg)}


def _refuse_taken(out: Path, files: dict) -> None:
    taken = [file for file in files if (out / file).exists()]
    if taken:
        raise UserError(f"{out} already has {', '.join(taken)}; choose another --out or remove them")


def run(args: argparse.Namespace) -> int:
    if args.target == "slurm":
        _check_slurm(args)
        files = slurm_script(args)
        out = Path(args.out)
        _refuse_taken(out, files)
        out.mkdir(parents=True, exist_ok=True)
        for file, text in files.items():
            (out / file).write_text(text)
        print(f"wrote {out / 'train.sbatch'} and its config; run it with: sbatch {out / 'train.sbatch'}")
        return 0
    if args.image is None:
        args.image = DEFAULT_IMAGES["cuda" if args.gpus_per_node else "cpu"]
    _check(args)
    manifests = training_manifests(args) if args.train else serving_manifests(args)
    out = Path(args.out)
    _refuse_taken(out, manifests)
    yaml = require("yaml", "deploy")

    class Dumper(yaml.SafeDumper):
        """Objects that share a dict (the labels) are written out in full, without YAML anchors."""

        def ignore_aliases(self, data) -> bool:
            return True

    out.mkdir(parents=True, exist_ok=True)
    for file, obj in manifests.items():
        (out / file).write_text(yaml.dump(obj, Dumper=Dumper, sort_keys=False))
    kinds = ", ".join(f"{obj['kind']} {obj['metadata']['name']}" for obj in manifests.values())
    print(f"wrote {kinds} to {out} (image {args.image}); run them with: kubectl apply -f {out}")
    return 0
