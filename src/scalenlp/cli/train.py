"""`scalenlp train`: one process, or N local processes through torchrun's own launcher.

With --nproc N (or --nnodes), this process validates the config first (so a bad key fails once,
before any worker starts), then hands over to torch.distributed.run, which starts the workers as
`python -m scalenlp train ...` and brings restarts and multi-node rendezvous with it. Under plain
`torchrun ... -m scalenlp train`, each worker lands directly in the single-process path.

Schedulers (scalenlp.launch_env): inside a Slurm step of one task per node, the allocation gives the launch
flags (nodes, rendezvous on its first node, GPUs per task); under mpirun, or srun with a task per process,
each task is one worker, given torchrun's variables from the launcher's.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from scalenlp.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (see configs/); defaults apply to what it omits")
    p.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override one config key; repeatable, e.g. --set training.steps=100")
    p.add_argument("--run-dir", metavar="DIR", help="where config, metrics, checkpoints and the export go "
                                                    "(default: runs/<model.flavor>, runs/custom without one)")
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="processes on this machine (default 1)")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="machines in the job; MIN:MAX is elastic (the job goes on while at least MIN remain)")
    p.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help="where the machines meet: one machine's address (it hosts the rendezvous), the same "
                        "on every machine; needed when --nnodes is above 1")
    p.add_argument("--rdzv-id", default="scalenlp", help="job id, the same on every machine of one job")
    p.add_argument("--local-addr", default="", metavar="ADDR",
                   help="the address other machines reach this one at (default: its host name)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of failed workers")
    p.add_argument("--rdzv-last-call", type=int, metavar="S",
                   help="with --nnodes MIN:MAX: seconds each rendezvous waits for more machines once MIN are in "
                        "(torchrun's last_call_timeout, default 30); after a machine is lost the job restarts no "
                        "sooner than this, so a short wait recovers sooner but may start without a slow machine")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve every rank's CPU, memory, GPU and training figures in Prometheus' format on port P "
                        "of each machine while training (same as --set monitor.metrics_port=P)")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="address --metrics-port listens on (default 127.0.0.1, this machine only; 0.0.0.0 for every "
                        "interface; same as --set monitor.metrics_host=ADDR)")
    p.add_argument("--metrics-token-file", metavar="FILE",
                   help="require the key on this file's first line as `Authorization: Bearer KEY` on --metrics-port "
                        "(default: the SCALENLP_METRICS_TOKEN environment variable's key, else none; same as --set "
                        "monitor.metrics_token_file=FILE)")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and exit")
    p.add_argument("--list-flavors", action="store_true", help="list the model flavors and exit")


def _children() -> list[int]:
    """Process ids of this process's children (the workers torchrun started), from Linux's /proc."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        pids += [int(pid) for pid in (task / "children").read_text().split()]
    return pids


def _pass_sigterm_on(signum: int, frame) -> None:
    """SIGTERM to the launcher (what Kubernetes sends) goes to the workers, which save a checkpoint at the
    next step boundary and exit 0; the launcher then ends with their exit codes, as after any run."""
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # exited meanwhile
            pass


def _is_own_address(endpoint: str) -> bool:
    """Whether the rendezvous endpoint is this machine, which then hosts the rendezvous store. torchrun
    guesses from the host name alone and misses addresses of a second interface; binding to it is the test."""
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        addresses = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(address)
                return True
            except OSError:  # not an address of this machine
                pass
    return False


def _launch(args: argparse.Namespace, run_dir: Path) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun's own SIGTERM handling kills the workers after 30 s and reports the launcher as failed;
    # ours passes the signal on and waits for what the workers make of it.
    launcher = ["--nproc-per-node", str(args.nproc), "--nnodes", args.nnodes, "--max-restarts",
                str(args.max_restarts), "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"]
    # c10d rendezvous numbers the machines in the order they join, so one command serves every machine.
    if args.rdzv_endpoint:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
        conf = ["is_host=true"] if _is_own_address(args.rdzv_endpoint) else []
        if args.rdzv_last_call is not None:
            conf.append(f"last_call_timeout={args.rdzv_last_call}")
        if conf:
            launcher += ["--rdzv-conf", ",".join(conf)]
    else:
        launcher += ["--standalone"]
    if args.local_addr:
        launcher += ["--local-addr", args.local_addr]
    worker = ["--run-dir", str(run_dir)] + [a for o in args.overrides for a in ("--set", o)]
    if args.config:
        worker += ["--config", args.config]
    # One thread per process unless the user chose otherwise: N processes share the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A restarted attempt must not find the previous attempt's process-group keys (gloo's and NCCL's peer
    # addresses) in the store: torchrun's agent keeps one store for all attempts, and the workers' keys in
    # it carry no attempt number (pytorch/pytorch#135712), so a restart would connect to the dead workers'
    # ports. With the store hosted per attempt by the workers' rank 0, every attempt starts clean.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    signal.signal(signal.SIGTERM, _pass_sigterm_on)
    try:
        run(get_args_parser().parse_args(launcher + ["--module", "scalenlp", "train"] + worker))
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        print(f"error: {len(e.failures)} training process(es) failed (exit codes {codes}); "
              f"see their messages above", file=sys.stderr)
        return 2 if codes == [2] else 1
    return 0


def node_counts(args: argparse.Namespace) -> range:
    """The machine counts the job may run with (one, or MIN..MAX when elastic), after checking that the
    launch flags fit together."""
    if args.nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {args.nproc}")
    parts = args.nnodes.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise UserError(f"--nnodes takes N or MIN:MAX with whole numbers of at least 1, got {args.nnodes!r}")
    low, high = int(parts[0]), int(parts[-1])
    if low > high:
        raise UserError(f"--nnodes {args.nnodes}: MIN is above MAX; write it as {high}:{low}")
    if high > 1 and not args.rdzv_endpoint:
        raise UserError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, one machine's address, "
                        f"the same on every machine")
    if args.rdzv_last_call is not None and (low == high or args.rdzv_last_call < 0):
        raise UserError(f"--rdzv-last-call {args.rdzv_last_call}: takes seconds (0 or more) and an elastic "
                        f"--nnodes MIN:MAX, the only case where the rendezvous waits for more machines")
    if low < high and args.max_restarts < 1:
        raise UserError(f"--nnodes {args.nnodes} is elastic, but a machine leaving or failing ends the job "
                        f"without restarts; add --max-restarts N")
    return range(low, high + 1)


def _slurm_launch(args: argparse.Namespace):
    """In a Slurm step of one task per node, and without launch flags of the user's: the allocation's job as
    --nnodes, --rdzv-endpoint (its first node), --rdzv-id and --nproc (the GPUs of each node's task); else None."""
    from scalenlp.launch_env import slurm_nodes

    job = slurm_nodes(dict(os.environ))
    if job is None or args.nnodes != "1" or args.rdzv_endpoint:
        return None
    if job.nproc is not None:
        if args.nproc not in (1, job.nproc):
            raise UserError(f"--nproc {args.nproc}, but the Slurm job gives each node's task {job.nproc} GPU(s) "
                            f"(SLURM_GPUS_PER_TASK, or SLURM_GPUS_ON_NODE); drop --nproc, or submit with "
                            f"--gpus-per-task={args.nproc}")
        args.nproc = job.nproc
    args.nnodes, args.rdzv_endpoint, args.rdzv_id = str(job.nnodes), job.endpoint, f"slurm-{job.job_id}"
    return job


def _train_as_rank(args: argparse.Namespace, cfg, run_dir: Path, launcher: str, variables: dict[str, str]) -> int:
    """mpirun, or srun with a task per process, started this process as one rank: train here, as a torchrun
    worker would, after checking the layout fits the world size. Only rank 0 says what does not fit."""
    from scalenlp.train.trainer import train, validate_run

    rank, world = int(variables["RANK"]), int(variables["WORLD_SIZE"])
    if args.nproc != 1 or args.nnodes != "1" or args.rdzv_endpoint:
        raise UserError(f"{launcher} started this process as rank {rank} of {world}: each task is one training "
                        f"process, so drop --nproc, --nnodes and --rdzv-endpoint")
    try:
        validate_run(cfg, world)
    except UserError as e:
        if rank:
            return 2
        raise UserError(f"{world} processes started by {launcher}: {e}") from None
    os.environ.update(variables)
    train(cfg, run_dir)
    return 0


def run(args: argparse.Namespace) -> int:
    from scalenlp.config import describe

    if args.help_config:
        print(describe())
        return 0
    if args.list_flavors:
        from scalenlp.models.flavors import FLAVORS, build_model
        for name, margs in FLAVORS.items():
            n = build_model(margs, "meta").num_params()
            print(f"{name:<12} {n / 1e6:>10.1f}M  dim={margs.dim} layers={margs.n_layers} heads={margs.n_heads}"
                  f" kv_heads={margs.n_kv_heads} {margs.position}/{margs.norm}/{margs.activation}")
        return 0
    for key in ("metrics_port", "metrics_host", "metrics_token_file"):  # workers receive them with the overrides
        if getattr(args, key) is not None:
            args.overrides.append(f"monitor.{key}={getattr(args, key)}")
    from scalenlp.train.tasks import load_config  # torch: after --help-config and --list-flavors

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or Path("runs") / (cfg.model.flavor or "custom"))
    from scalenlp.launch_env import rank_env
    from scalenlp.loader import read
    from scalenlp.train.trainer import train, validate_run

    ranks = rank_env(dict(os.environ))
    if ranks is not None:
        return _train_as_rank(args, cfg, run_dir, *ranks)
    job = _slurm_launch(args)
    nodes = node_counts(args)
    if args.nproc > 1 or max(nodes) > 1 or args.rdzv_endpoint:
        pretrained = read(cfg.model.init) if cfg.model.init else None
        for n in nodes:  # an elastic job must fit every world size it may shrink or grow to
            try:
                validate_run(cfg, args.nproc * n, pretrained)
            except UserError as e:
                if job is None:
                    raise
                per_gpu = " (one per GPU of its task)" if job.nproc else ""
                raise UserError(f"Slurm job {job.job_id} runs {n} node(s) x {args.nproc} process(es){per_gpu}: "
                                f"{e}") from None
        return _launch(args, run_dir)
    train(cfg, run_dir)
    return 0
