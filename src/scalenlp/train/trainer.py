"""The training loop: one process of a (possibly) distributed run, launched by torchrun or alone.

What is learnt is the task's (training.task, scalenlp.train.tasks): its data, model, loss, evaluation and
export. Setup: process group and mesh -> the checkpoint to resume from -> the task's data (for lm and sft rank 0
prepares, everyone memory-maps) and model, built with the same seed on every rank -> parallelize -> optimizer,
schedule -> resume. Then each step: split this rank's share of the global batch into micro-batches, accumulate
gradients of the task's loss, clip, step, and every ``log_every`` steps reduce the loss over data-parallel ranks
and write one metrics record; every ``eval_every`` the task evaluates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from scalenlp import faults
from scalenlp.config import Config, ConfigError, profile_steps, save_config, validate
from scalenlp.errors import UserError
from scalenlp.layout import Layout
from scalenlp.loader import read
from scalenlp.models.adapter_io import ADAPTER_FOLDER, write_adapter
from scalenlp.models.adapters import adaptable, adapter_weights, frozen_shapes, merge_adapters, pack_frozen
from scalenlp.models.flavors import shape_spec
from scalenlp.models.frozen import refusal, run_layouts
from scalenlp.models.io import save_pretrained
from scalenlp.models.pretrained import Pretrained
from scalenlp.parallel.data_parallel import skip_gradient_sync
from scalenlp.parallel.mesh import ParallelDims, barrier, build_mesh, device_type, dp_rank, init_distributed
from scalenlp.parallel.parallelize import check_layout, clip_grad_norm_, dp_mesh, loss_context, parallelize
from scalenlp.parallel.pipeline import build_pipeline
from scalenlp.parallel.tensor_parallel import split_dim
from scalenlp.train import recovery, watchdog
from scalenlp.train.checkpoint import STATE_FILE, Checkpointer, load_full_model, read_train_state
from scalenlp.train.frozen_packing import PackingChoice, choose_packing, memory_budget
from scalenlp.train.guard import StepCheck, StopRequest, check_step, weights_finite
from scalenlp.train.loss import AUTOCAST, autocast, cross_entropy, loss_scaler, sum_over
from scalenlp.train.metrics import MetricsWriter, peak_memory_bytes
from scalenlp.train.monitor import Monitor
from scalenlp.train.optim import build_optimizer, build_scheduler, lr_factor
from scalenlp.train.peak import peak_flops
from scalenlp.train.profile import StepProfiler
from scalenlp.train.tasks import task_for
from scalenlp.train.tracking import check_installed, open_trackers


def batch_shape(cfg: Config, dims: ParallelDims) -> tuple[int, int]:
    """(sequences per micro-batch on one rank, micro-batches per step)."""
    local = cfg.training.global_batch_size // dims.dp
    if dims.pp > 1:  # the pipeline schedule splits the local batch into parallel.pp_microbatches itself
        return local, 1
    micro = Layout.from_config(cfg, dims.world_size).microbatch
    return micro, local // micro


def validate_run(cfg: Config, world_size: int, pretrained: Pretrained | None = None) -> ParallelDims:
    """Every check that needs no process group and no data, so a launcher can fail before starting N processes.
    With model.init the checkpoint is read here unless given (``pretrained``)."""
    task = task_for(cfg)
    check_installed(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    if cfg.model.init and pretrained is None:
        pretrained = read(cfg.model.init)
    if pretrained is not None and pretrained.quantization is not None:
        raise ConfigError(f"model.init={cfg.model.init} is quantized ({pretrained.quantization.describe()}); fine-tune "
                          f"its floating-point original, then quantize the result")
    args = task.model_args(cfg, pretrained)
    check_layout(args, dims, cfg)
    with torch.device("meta"):  # [lora]'s targets, ranks and lora.init against the model, at no cost
        model = task.model_class(args)
        task.add_adapters(cfg, model, quantize=False)
    if cfg.lora.quantize_base:
        from scalenlp.compress.nf4 import check_shardable

        zero = cfg.parallel.data_parallel in ("zero2", "zero3")
        check_shardable(model, adaptable(model), dims.dp_shard if zero else 1, dims.tp, split_dim)
    return dims


def pick_device(cfg: Config) -> torch.device:
    wanted = cfg.training.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is visible; use training.device=cpu or auto")
    if wanted == "cpu" or device_type() == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _mean_over(value: torch.Tensor, group) -> float:
    return (sum_over(value, group) / (1 if group is None else dist.get_world_size(group))).item()


@dataclasses.dataclass
class _Window:
    """The steps one metrics record averages over: those since the last record (or rollback). The tokens and
    targets they saw are counted on the trainer, by ``train_step``."""
    loss: torch.Tensor
    steps: int = 0
    time: float = 0.0


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path, stop: StopRequest | None = None):
        validate(cfg)  # a Config built in Python gets the checks load_config gives the CLI's
        self.task = task_for(cfg)  # and its training.task's own
        self.cfg, self.run_dir, self.stop = cfg, Path(run_dir), stop
        watchdog.record_collectives()
        self.rank, self.world = init_distributed(cfg.training.timeout_s, cfg.training.param_dtype == "bfloat16")
        # model.init: every rank reads the checkpoint (memory-mapped where the format allows); its
        # tokenizer tokenizes the data, its weights are assigned below, its tokenizer config is exported.
        pretrained = read(cfg.model.init) if cfg.model.init else None
        self.tokenizer_config = pretrained.tokenizer_config if pretrained else {}
        self.dims = validate_run(cfg, self.world, pretrained)
        self.device = pick_device(cfg)
        self.mesh = build_mesh(self.dims)
        self.dp_group = None if self.mesh is None or self.dims.dp == 1 else dp_mesh(self.mesh, flat=True).get_group()
        self.is_main = self.rank == 0
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep, self.rank,
                                         cfg.checkpoint.async_save, self.log)
        latest, agents, restarted = self._find_resume_point()
        t = self.cfg.training  # self.cfg: with the resumed checkpoint's micro-batch size where it had another
        self.micro_batch, self.accum = batch_shape(self.cfg, self.dims)
        # Data, then the model, from the same seed on every rank: a new head or a random model starts from the
        # weights of the single-process run under every layout, before parallelize shards or splits it.
        torch.manual_seed(t.seed)
        self.loader = self.task.build_data(self.cfg, self.run_dir, pretrained, dp_rank(self.mesh), self.dims.dp,
                                           self.log)
        self.model_args, model = self.task.build_model(self.cfg, pretrained, self.device)
        self.task.add_adapters(self.cfg, model)  # [lora]; initialised from the seed too, after the model
        del pretrained  # the model holds the weights now
        self._parallelize(model)
        torch.manual_seed(t.seed + 1 + self.rank)  # dropout streams differ per rank, reproducibly
        self.step = 0
        self.tokens_seen = 0  # by this rank since the last metrics record
        self.targets_seen = 0  # counted by the loss, all data-parallel ranks together, since then (a tensor)
        self.best: dict | None = None  # {"step", keep_best's metric: value} of the best evaluation so far
        self.rolled_back_to = None
        if latest is not None:
            self._resume(latest)
            self.log(f"resumed from {latest} at step {self.step}")
        self._open_run(agents, restarted)

    # -- setup ------------------------------------------------------------------------------------
    def _find_resume_point(self) -> tuple[Path | None, list, bool]:
        """(the checkpoint this run continues from or None, torchrun's agents, whether torchrun restarted it),
        every check on the run folder and that checkpoint passed; keeps the checkpoint's micro-batch size."""
        # A restart by torchrun resumes by itself, from the newest checkpoint that is whole (see recovery.py).
        restarted, agents = recovery.continues_launch(self.run_dir)
        verified = None  # (path, train state) rank 0 has already checked
        if restarted and self.is_main:
            verified = recovery.set_aside_damaged(self.checkpointer, self.log)
        barrier()
        resume = self.cfg.checkpoint.resume
        latest = self.checkpointer.latest() if resume or restarted else None
        # Nothing is written to the run folder before every check has passed, the checkpoint's included.
        if self.is_main:
            if self.checkpointer.complete() and not resume and not restarted:
                raise UserError(f"{self.run_dir} already has checkpoints; pass --set checkpoint.resume=true to "
                                f"continue that run, or choose a new --run-dir")
            if resume and latest is None:
                self.log(f"checkpoint.resume=true but {self.run_dir / 'checkpoints'} has no complete checkpoint; "
                         f"starting from step 0")
            if latest is not None:
                self._check_resumable(latest, verified[1] if verified and verified[0] == latest
                                      else read_train_state(latest))
        barrier()
        if latest is not None:
            self.cfg = recovery.keep_micro_batch(self.cfg, json.loads((latest / STATE_FILE).read_text()),
                                                 self.dims, self.log)
        return latest, agents, restarted

    def _parallelize(self, model: torch.nn.Module) -> None:
        """Shard or split the whole model as parallel.* says; an optimizer and a schedule for each part."""
        t = self.cfg.training
        self.n_params = model.num_params()
        self.n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.flops_per_token = model.flops_per_token(t.seq_len)
        self.loss_weight = torch.ones((), device=self.device)  # see _weigh_loss
        if self.dims.pp > 1:
            self.pipeline, self.model_parts = build_pipeline(model, self.dims, self.mesh, self.cfg, self._pipeline_loss)
        else:
            self.pipeline, self.model_parts = None, [parallelize(model, self.dims, self.mesh, self.cfg)]
        if self.cfg.lora.pack_frozen != "off" and (self.cfg.lora.rank or self.cfg.lora.init):
            self._pack_frozen()
        self.optimizers = [build_optimizer(part, t, self.dims, self.mesh, self.cfg.parallel.data_parallel)
                           for part in self.model_parts]
        self.schedulers = [build_scheduler(opt, t) for opt in self.optimizers]
        self.scheduler = self.schedulers[0]  # all parts follow the same schedule
        self.scaler = loss_scaler(t, self.device)
        self.skipped_steps = 0  # fp16 steps whose gradient overflowed, since the run began

    def _pack_frozen(self) -> None:
        """lora.pack_frozen (a layout, or auto's where one measured faster here), once the layout has sharded what
        it shards (a sharded base is left as it is); DDP ignores the frozen weights, so dropping them frees their
        memory."""
        t = self.cfg.training
        rows = self.micro_batch * t.seq_len
        parts = [getattr(part, "module", part) for part in self.model_parts]  # DDP's wrapper
        wanted = self.cfg.lora.pack_frozen
        dtype = AUTOCAST.get(t.mixed_precision, torch.float32)  # the products'
        layouts = run_layouts(dtype, t.compile)
        held, reasons, why_auto = Counter(), [], ""
        if wanted not in ("auto", *layouts):
            reasons.append(refusal(wanted, dtype, t.compile))
        else:
            layout = wanted
            if wanted == "auto":
                choice = self._one_packing_choice(sum((frozen_shapes(part) for part in parts), Counter()), rows,
                                                  layouts, dtype)
                layout, why_auto = (choice.layouts, f" (auto: {choice.reason})") if choice else ({}, "")
            for part in parts:
                n, why = pack_frozen(part, rows, layout, dtype)
                held += n
                reasons += [r for r in why if r not in reasons]
        how = {"onednn": "as oneDNN-packed W and W^T", "transposed": "beside a row-major copy of W^T",
               "mkl": "beside an MKL-packed copy of W", "cast": "beside a copy of W"}
        cast = "" if dtype == torch.float32 else f" cast to {t.mixed_precision}"
        said = ", ".join(f"{n} frozen linears held {how[name]}{cast}" for name, n in held.items())
        self.log(f"lora.pack_frozen: {said or 'the frozen base kept as it is'}"
                 + (f"; not packed: {'; '.join(reasons)}" if reasons else "") + why_auto)

    def _one_packing_choice(self, shapes: Counter[tuple[int, int]], rows: int, layouts: tuple[str, ...],
                            dtype: torch.dtype) -> PackingChoice | None:
        """lora.pack_frozen=auto's layouts for the frozen ``shapes`` of every rank (a pipeline stage holds its own):
        rank 0 decides and tells the others. Ranks timing apart could decide apart, their products then rounding
        apart, and a resumed run could read another rank's decision from the cache than the one it ran with."""
        if self.world > 1:
            every: list[Counter | None] = [None] * self.world
            dist.all_gather_object(every, shapes)
            shapes = Counter()
            for held in every:
                shapes |= held  # per shape, the most any rank holds
        choice = [None]
        if shapes and self.is_main:
            # The copies are each process's own: rank 0's machine shares its memory among the processes it runs.
            budget = memory_budget(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            choice = [choose_packing(shapes, rows, layouts, budget=budget, dtype=dtype)]
        if self.world > 1 and shapes:
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _open_run(self, agents: list, restarted: bool) -> None:
        """Write the config and the launch to the run folder; start the watchdog, the metrics and the monitor."""
        t = self.cfg.training
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.run_dir / "config.toml")
            recovery.record_launch(self.run_dir, agents, restarted)
        # Under torchrun only: ending a hung attempt hands it to torchrun, which restarts it (or fails the job
        # now rather than at the process-group timeout); a lone process has no one to hand it to.
        self.watchdog = watchdog.Watchdog(self.run_dir, self.rank, self.world, t.hang_timeout, t.timeout_s,
                                          enabled=bool(agents))
        barrier()
        self.fault = faults.planned(self.rank)

        dtype = AUTOCAST.get(t.mixed_precision, torch.bfloat16 if t.param_dtype == "bfloat16" else torch.float32)
        self.peak = peak_flops(self.device, dtype, t.peak_tflops)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_main,
                                     sinks=open_trackers(self.cfg, self.run_dir, self.log) if self.is_main else None)
        self.monitor = Monitor(self.cfg.monitor, self.device, self.rank)

    # -- helpers --------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.rank == 0:
            tqdm.write(msg, file=sys.stderr)

    def _train_state(self) -> dict:
        t = self.cfg.training
        return {"data": self.loader.state_dict(), "scheduler": self.scheduler.state_dict(),
                "global_batch_size": t.global_batch_size, "seq_len": t.seq_len, "world_size": self.world,
                "layout": self.dims.names_and_sizes(), "best": self.best,
                **({"loss_scale": self.scaler.state_dict(), "skipped_steps": self.skipped_steps} if self.scaler else {})}

    def _check_resumable(self, path: Path, state: dict) -> None:
        t = self.cfg.training
        for key in ("global_batch_size", "seq_len"):
            if state.get(key) != getattr(t, key):
                raise UserError(f"checkpoint {path} was trained with training.{key}={state.get(key)}, this run has "
                                f"{getattr(t, key)}; the data position only carries over with the same value")

    def _resume(self, path: Path) -> None:
        state = self.checkpointer.load(path, self.model_parts, self.optimizers)
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["data"])
        self.step = state["step"]
        self.best = state.get("best")
        if self.scaler is not None and "loss_scale" in state:  # an fp32 or bf16 checkpoint starts the scale afresh
            # The scale and its progress towards growing carry over; the factors are this run's config's.
            saved = state["loss_scale"]
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": saved["scale"],
                                         "_growth_tracker": saved["_growth_tracker"]})
            self.skipped_steps = state["skipped_steps"]

    def _roll_back(self, check: StepCheck) -> None:
        """training.on_nonfinite=rollback: the newest checkpoint's weights, optimizer and schedule, with the
        data read on from here (the same batches would lead to the same state). Once per checkpoint: a
        second failure before a newer one exists stops the run."""
        self.checkpointer.wait()
        latest = self.checkpointer.latest()
        if latest is None or latest == self.rolled_back_to:
            raise UserError(f"{check.describe(self.step)}, and "
                            + ("there is no checkpoint to roll back to" if latest is None else
                               f"it happened again after rolling back to {latest}")
                            + "; stopped before saving anything from it. Lower training.lr, or check the data")
        self.log(f"{check.describe(self.step)}; rolling back to {latest} (training.on_nonfinite=rollback)")
        if self.is_main:
            read_train_state(latest)
        barrier()
        data = self.loader.state_dict()
        self._resume(latest)
        self.loader.load_state_dict(data)
        self.rolled_back_to = latest

    def _new_window(self) -> _Window:
        self.tokens_seen = self.targets_seen = 0
        return _Window(torch.zeros((), device=self.device))

    # -- the step ---------------------------------------------------------------------------------
    def _weigh_loss(self, batch: tuple[torch.Tensor, ...]) -> None:
        """Set ``loss_weight`` so that summed micro-batch losses times it, summed over micro-batches and
        averaged over data-parallel ranks (as DDP / FSDP average gradients), give the mean over every
        counted target of the global batch. Targets are not all counted (SFT ignores all but the
        assistant's tokens) and their number differs between micro-batches and ranks, so averaging
        per-micro-batch means would give a token more weight the fewer counted tokens share its
        micro-batch, and so a different loss under each layout. One scalar all-reduce per step."""
        counted = sum_over(self.task.counted_targets(batch).float(), self.dp_group)
        self.loss_weight = self.dims.dp / counted
        self.targets_seen += counted

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The schedule divides gradients by the number of micro-batches (it expects mean losses), and the
        # runner reports the mean of these values: multiplying by that number undoes both. The schedule runs
        # the backward pass itself, so fp16's loss scale is in loss_weight during a training step.
        microbatches = self.cfg.parallel.pp_microbatches or self.dims.pp
        return cross_entropy(logits, targets, reduction="sum") * self.loss_weight * microbatches

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, StepCheck]:
        """One optimizer step over this rank's share of the global batch; (loss, grad norm) on this rank and
        what every rank agreed on. A step whose loss or gradient is not finite updates nothing."""
        batch = [x.to(self.device, non_blocking=True) for x in self.loader.next_batch()]
        self.tokens_seen += batch[0].numel()
        self._weigh_loss(batch)
        loss_sum = torch.zeros((), device=self.device)
        scaled = self.scaler.scale if self.scaler is not None else lambda x: x  # fp16: keep small gradients
        if self.pipeline is not None:  # the schedule runs the micro-batches (pp_microbatches) itself
            scale = scaled(torch.ones((), device=self.device))
            self.loss_weight = self.loss_weight * scale
            with autocast(self.device, self.cfg.training.mixed_precision):
                loss_sum += self.pipeline.step(*batch, self.task.positions(batch[0])) / scale
        else:
            for i, micro in enumerate(zip(*(x.split(self.micro_batch) for x in batch))):
                # Gradients are reduced across data-parallel ranks only after the last micro-batch.
                with contextlib.nullcontext() if i == self.accum - 1 else skip_gradient_sync(self.model_parts):
                    with loss_context(self.dims, self.cfg):
                        with autocast(self.device, self.cfg.training.mixed_precision):
                            loss = self.task.micro_batch_loss(self.model_parts[0], micro, self.dims) * self.loss_weight
                        scaled(loss).backward()
                loss_sum += loss.detach()
        params = [p for part in self.model_parts for p in part.parameters()]
        faults.overflow(self.fault, self.step + 1, params)
        if self.scaler is not None:  # the norm and its clipping are of the true gradients
            for optimizer in self.optimizers:
                self.scaler.unscale_(optimizer)
        pp_mesh, second_copies = (self.mesh["pp"], self.pipeline.second_copies()) if self.pipeline else (None, [])
        # A tied embedding's two pipeline copies hold the same gradient: the norm counts it once.
        grad_norm = clip_grad_norm_(params, self.cfg.training.grad_clip, pp_mesh, counted_elsewhere=second_copies)
        check = check_step(loss_sum, grad_norm, self.stop, overflow_expected=self.scaler is not None)
        # fp16: a gradient that overflowed on any rank makes the norm, the same on every rank, not finite. The
        # update is skipped here rather than by scaler.step, whose way of skipping (found_inf handed to the
        # fused AdamW) left tensor-parallel weights NaN after an overflow (tp=2, torch 2.13).
        overflow = self.scaler is not None and not torch.isfinite(grad_norm)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            if check.finite and not overflow:
                optimizer.step()
            with warnings.catch_warnings():  # after a skipped first update (an fp16 overflow, say), torch warns
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                scheduler.step()  # a skipped step still counts: the schedule stays a function of the step
            optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()  # backs off after an overflow, grows after loss_scale_interval steps without
            self.skipped_steps += overflow
        return loss_sum, grad_norm, check

    def save(self, wait: bool = True) -> Path:
        """Checkpoint this step; ``wait=False`` lets an asynchronous save (checkpoint.async_save) write on."""
        if not weights_finite(self.model_parts):
            latest = self.checkpointer.latest()
            raise UserError(f"step {self.step}: the weights are not finite after a finite gradient; nothing saved or "
                            f"exported (newest good checkpoint: {latest or 'none'}). Lower training.lr")
        return self.checkpointer.save(self.step, self.model_parts, self.optimizers, self._train_state(), wait)

    def export(self, checkpoint: Path, folder: str = "export", extra_files: dict[str, str] | None = None) -> None:
        """Rank 0 reads a checkpoint into one unsharded model (DCP reshards from any layout) and writes
        safetensors + model args (an encoder's with its labels) + tokenizer + resolved config to
        <run_dir>/<folder>."""
        if self.is_main:
            lora = self.cfg.lora.rank or self.cfg.lora.init
            if lora:  # the checkpoint holds the adapters (and a head): the frozen base comes from model.init again
                _, model = self.task.build_model(self.cfg, read(self.cfg.model.init), torch.device("cpu"))
                self.task.add_adapters(self.cfg, model)
            else:
                model = self.task.model_class(self.model_args)
            load_full_model(checkpoint, model)
            adapter = adapter_weights(model) if lora else None
            try:
                out = save_pretrained(merge_adapters(model) if lora else model, self.run_dir / folder,
                                      self.task.tokenizer,
                                      {"config.toml": (self.run_dir / "config.toml").read_text(), **(extra_files or {})},
                                      tokenizer_config=self.tokenizer_config)
            except UserError as e:  # a full disk: the checkpoint is whole, only its export is missing
                raise UserError(f"{e} (the weights are in {checkpoint}: once there is space, --set "
                                f"checkpoint.resume=true exports them without training)") from None
            if adapter is not None:  # beside the merged model: what `scalenlp export --format peft` writes out
                write_adapter(out / ADAPTER_FOLDER, self.task.lora_spec, adapter, None,
                              self.cfg.model.init)
            self.log(f"exported weights of {checkpoint.name}: {out}" + (" (LoRA merged; the adapter alone in "
                                                                       f"{ADAPTER_FOLDER}/)" if lora else ""))
        barrier()

    def keep_if_best(self, scores: dict[str, float]) -> Path | None:
        """Save and export to <run_dir>/best when ``scores`` beat the best so far by checkpoint.keep_best;
        the checkpoint saved, if any."""
        metric = self.cfg.checkpoint.keep_best
        if not metric or self.best is not None and scores[metric] <= self.best[metric]:
            return None
        self.best = {"step": self.step, metric: scores[metric]}
        path = self.save()
        self.export(path, "best", {"best.json": json.dumps({**self.best, "scores": scores}, indent=1)})
        return path

    def evaluate_and_record(self) -> Path | None:
        """Evaluate, write the record to metrics.jsonl and log it; the checkpoint saved as the new best, if any."""
        self.loss_weight = torch.ones((), device=self.device)  # the pipeline's losses are then plain sums
        scores = self.task.evaluate(self)
        if scores is None:
            return None
        self.metrics.write({"step": self.step, **scores})
        self.log(f"step {self.step:>6} | {self.task.describe(scores)}")
        return self.keep_if_best(scores)

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        t = self.cfg.training
        self._log_setup()
        records, last_saved, stopping = [], None, False
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", disable=not self.is_main,
                   dynamic_ncols=True, file=sys.stderr)
        window = self._new_window()
        profiler = StepProfiler(profile_steps(self.cfg), self.step, self.run_dir / "traces" / f"rank{self.rank}.json",
                                self.device, self.log)
        while self.step < t.steps and not stopping:
            start = time.perf_counter()
            self.watchdog.step_started(self.step + 1)
            with profiler.step(self.step + 1):
                loss, grad_norm, check = self.train_step()
            self.checkpointer.poll()
            window.loss += loss
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            window.time += time.perf_counter() - start
            window.steps += 1
            self.step += 1
            bar.update(1)
            faults.inject(self.fault, self.step, self.checkpointer)
            if not check.finite and self._after_nonfinite(check):  # rolled back: on from the checkpoint's step
                bar.n = self.step
                window = self._new_window()
                continue
            if self.step % t.log_every == 0 or self.step == t.steps:
                records.append(self._record(window, grad_norm, bar))
                window = self._new_window()
            self.watchdog.step_finished()  # evaluations and saves are bounded by training.timeout_s instead
            stopping = check.stop and self.step < t.steps  # at the last step the run simply ends
            last_saved = self._evaluate_and_save(stopping) or last_saved
        bar.close()
        profiler.close()
        self._finish(last_saved, stopping)
        return records

    def _log_setup(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.log(f"model {cfg.model.init or shape_spec(cfg.model)}: {self.n_params / 1e6:.2f}M parameters"
                 + (f" ({self.n_trained / 1e6:.3f}M trained: LoRA)" if self.n_trained < self.n_params else "") + ", "
                 f"{self.flops_per_token / 1e6:.1f} MFLOPs/token | layout "
                 + " ".join(f"{n}={s}" for n, s in self.dims.names_and_sizes())
                 + (f" ({cfg.parallel.data_parallel})" if self.dims.dp > 1 else "")
                 + f" on {self.world} x {self.device.type} | batch {t.global_batch_size} x {t.seq_len} tokens "
                 f"({self.accum} micro-batch(es) of {self.micro_batch}/rank) | peak {self.peak.flops / 1e12:.3f} "
                 f"TFLOP/s per process ({self.peak.source})")

    def _after_nonfinite(self, check: StepCheck) -> bool:
        """training.on_nonfinite after a step whose loss or gradient is not finite: stop (raise), skip its update
        (False: the loop goes on) or roll back (True)."""
        t = self.cfg.training
        if t.on_nonfinite == "stop":
            latest = self.checkpointer.latest()
            raise UserError(f"{check.describe(self.step)}; stopped before saving or exporting anything "
                            f"from it (newest good checkpoint: {latest or 'none'}). Lower training.lr, or "
                            f"set training.on_nonfinite=skip or rollback")
        if t.on_nonfinite == "rollback":
            self._roll_back(check)
            return True
        self.log(f"{check.describe(self.step)}; its update is skipped (training.on_nonfinite=skip)")
        return False

    def _record(self, window: _Window, grad_norm: torch.Tensor, bar: tqdm) -> dict:
        """The metrics record of the steps in ``window``: written, published, shown on ``bar`` and logged."""
        t = self.cfg.training
        # Tokens the model ran on, padding included (classification batches are padded to their longest
        # row, SFT rows to seq_len): the model computes on padding too, so MFU counts it.
        tokens_per_sec = self.tokens_seen * self.dims.dp / window.time
        mfu, peak_note = self.peak.mfu(tokens_per_sec / self.world * self.flops_per_token)
        if peak_note:
            self.log(f"step {self.step}: {peak_note}")
        record = {
            "step": self.step,
            "loss": _mean_over(window.loss / window.steps, self.dp_group),
            "lr": t.lr * lr_factor(self.step - 1, t),  # what this step ran with (the scheduler is one on)
            "grad_norm": grad_norm.item(),
            "tokens_per_sec": tokens_per_sec,
            "mfu": mfu,
            "peak_tflops": self.peak.flops / 1e12,
            "peak_source": self.peak.source,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "step_time_s": window.time / window.steps,
            "samples_per_sec": window.steps * t.global_batch_size / window.time,
            **self.task.record(self.targets_seen, window.time),
            # fp16: the scale the next step starts from, and the steps skipped for an overflow so far.
            **({"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped_steps} if self.scaler else {}),
        }
        record.update(self.monitor.gather())  # every rank's CPU and memory (a collective)
        self.monitor.publish(record)
        self.metrics.write(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tokens_per_sec:,.0f}")
        self.log(f"step {self.step:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm "
                 f"{record['grad_norm']:.3f} | {tokens_per_sec:,.0f} tok/s | MFU {record['mfu']:.1%} | "
                 f"peak mem {record['peak_mem_bytes'] / 2**20:,.0f} MiB" + self.task.progress(record))
        return record

    def _evaluate_and_save(self, stopping: bool) -> Path | None:
        """Evaluate when training.eval_every says, and checkpoint when checkpoint.every says, at the last step
        or before stopping; the checkpoint saved, if any (a new best is one)."""
        t, every = self.cfg.training, self.cfg.checkpoint.every
        last = self.step == t.steps
        if t.eval_every and (self.step % t.eval_every == 0 or last):
            saved_best = self.evaluate_and_record()
            if saved_best is not None:
                return saved_best
        if stopping or every and self.step % every == 0 or last:
            return self.save(wait=stopping or last)
        return None

    def _finish(self, last_saved: Path | None, stopped: bool) -> None:
        """Export the final checkpoint (checkpoint.export), or say how a stopped run continues; close the
        metrics and the trackers, which receive the export."""
        exported = None
        if stopped:
            got = self.stop.signal if self.stop is not None and self.stop.signal else "a signal to another rank"
            self.log(f"stopped by {got} after step {self.step} of {self.cfg.training.steps}: checkpoint saved to "
                     f"{last_saved}; continue with --set checkpoint.resume=true")
        else:
            if last_saved is None:  # resumed at the final step: nothing new was trained
                last_saved = self.checkpointer.latest()
            if self.cfg.checkpoint.export and last_saved is not None:
                self.export(last_saved)
                exported = self.run_dir / "export"
        self.metrics.close(exported)
        self.monitor.close()


def train(cfg: Config, run_dir: Path) -> list[dict]:
    """Run training in this process (one rank of a torchrun job, or alone); metric records of rank 0."""
    try:
        with StopRequest() as stop:
            trainer = Trainer(cfg, run_dir, stop)
            with trainer.watchdog:
                return trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
