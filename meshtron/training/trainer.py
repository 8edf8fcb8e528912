"""The training loop: global batches of micro batches, schedule, logging, evaluation, checkpoints.

It knows nothing of the model or of how it is parallelized: it moves the dataset's batches to
the device, asks the runner (``meshtron.parallel.runner``) to run them forward and backward, the
optimizer for a step, and the checkpoint module to save and load.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from meshtron.checkpoint.checkpoint import CheckpointError, PendingSave, latest_iteration, load_for_training, start_save
from meshtron.checkpoint.pretrained import load_pretrained_encoders
from meshtron.checkpoint.retention import prune
from meshtron.checkpoint.save_dir import SaveLock, claim_save_dir
from meshtron.checkpoint.sharded import save_state, state_bytes
from meshtron.checkpoint.staging import HostStaging
from meshtron.config import Config
from meshtron.validation import validate
from meshtron.data.builder import MicroBatchIterator
from meshtron.data.data_sources import names_data
from meshtron.flags import noted_flag_lines
from meshtron.models import model_flops_per_token, parameter_count, sample_tokens, spec_for
from meshtron.optim.lr_schedule import LRSchedule
from meshtron.parallel.mesh import init_distributed, restart_store_note
from meshtron.parallel.setup import build_runner
from meshtron.training import flight_recorder
from meshtron.training.batch_schedule import BatchSchedule, planned_samples
from meshtron.training.divergence import DivergenceError, DivergenceMonitor
from meshtron.training.garbage import ManualCollection, empty_unused_memory
from meshtron.training.metrics import IntervalMeter, MetricsWriter, describe_bases, format_log_line, memory_scalars, mfu_bases
from meshtron.training.profiler import StepProfiler
from meshtron.training.sample_plan import decoupled_schedule_note, plan_samples, planned_datasets, schedule_note
from meshtron.training.stop import StopAgreement, StopSignals, describe
from meshtron.training.straggler import StragglerTimes, report
from meshtron.training.vocab import model_vocab_size, run_tokenizer, token_vocab_size
from meshtron.training.watchdog import Watchdog, set_training_timeout

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no GPU is visible; use --device cpu or auto")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def resolve_precision(choice: str, device: torch.device) -> str:
    """``auto`` is bf16 on a GPU that has it and fp32 on the CPU."""
    if choice != "auto":
        return choice
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def setup_data_source(cfg: Config, log: Callable[[str], None]) -> list[str] | None:
    """Fill in the embedded corpus (as the model type reads it) when no data is named; returns its
    prefixes (None otherwise)."""
    data = cfg.data
    if data.mock or names_data(data):
        return None
    from meshtron.data.default_data import default_data

    cache = Path(data.data_cache_path or Path.home() / ".cache" / "meshtron" / "embedded")
    start = time.perf_counter()
    prefix, tokenizer_fields = default_data(str(cache), spec_for(cfg.model).sentence_data)
    files = ", ".join(v for k, v in tokenizer_fields.items() if k != "tokenizer_type")
    log(f"embedded corpus ready in {time.perf_counter() - start:.1f}s: {prefix} ({tokenizer_fields['tokenizer_type']} {files})")
    for name, value in tokenizer_fields.items():
        setattr(data, name, value)
    return [prefix]


@dataclass
class TrainResult:
    iteration: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    valid_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: str = ""


class Trainer:
    """Builds every part from one config, then ``run()`` trains until an exit condition."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        validate(cfg)  # every rule, the layout's included, before any process group or GPU is touched
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here, start-up included
        self.cfg, self.log = cfg, log
        t = cfg.train
        self.device = resolve_device(t.device)
        self.precision = resolve_precision(t.precision, self.device)
        if self.precision == "bf16" and self.device.type == "cpu":
            log("note: bf16 on the CPU is slow; fp32 is the CPU default")

        flight_recorder.enable()  # before the first process group: the watchdog dumps it on a hang
        self.mesh = init_distributed(cfg.parallel, self.device.type)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU
        if self.mesh.rank != 0:
            self.log = log = _silent  # one voice: global rank 0 logs
        self.say = log if self.mesh.world_size == 1 else lambda line: print(f"rank {self.mesh.rank}: {line}", flush=True)  # what any rank must tell
        log(self.mesh.describe() if self.mesh.world_size > 1 else "mesh: one process")
        for line in [*noted_flag_lines(cfg.logging.noted_flags), restart_store_note()]:
            if line:
                log(line)

        data_prefixes = self._setup_data_source_once()
        self.tokenizer = run_tokenizer(cfg)
        self.vocab_size = token_vocab_size(cfg, self.tokenizer)
        self.padded_vocab_size = model_vocab_size(cfg, self.tokenizer)  # the tables' rows: parameters and FLOPs count them
        self.dtype = PRECISION_DTYPES[self.precision]
        self.runner = build_runner(cfg, self.mesh, self.vocab_size, self.device, self.dtype)
        self.model, self.optimizer = self.runner.model, self.runner.optimizer
        self.schedule = LRSchedule.from_config(t)
        self.decoupled_schedule = LRSchedule.decoupled_from_config(t)  # --decoupled-lr: the embeddings' and output layer's
        self.last_decoupled_lr: float | None = None
        self.batch_schedule = BatchSchedule.from_config(t)  # --rampup-batch-size: the step's batch follows the consumed samples
        self.micro_samples = t.micro_batch_size * self.mesh.dp  # global samples per micro batch
        self.num_micro_batches = t.global_batch_size // self.micro_samples  # of a full global batch (evaluation's)
        self.last_batch_size, self.last_lr = t.global_batch_size, 0.0  # of the last step taken

        self.iteration, self.consumed_samples = 0, 0
        meta = None
        if cfg.checkpoint.load:
            meta = load_for_training(cfg.checkpoint, self.model, self.optimizer, self.mesh, log, self.runner.metas)
            if meta is None and cfg.checkpoint.exit_on_missing_checkpoint:
                raise CheckpointError(f"no checkpoint in {cfg.checkpoint.load} and --exit-on-missing-checkpoint is set")
            if meta is None:
                log(f"no checkpoint in {cfg.checkpoint.load} yet: starting from scratch")
            else:
                self.iteration, self.consumed_samples = meta["iteration"], meta["consumed_samples"]
                log(f"resumed from {cfg.checkpoint.load} at iteration {self.iteration}")
        c = cfg.checkpoint
        resumed_here = meta is not None and not c.finetune and bool(c.load) and Path(c.load).resolve() == Path(c.save or ".").resolve()
        self.save_lock = self._claim_save_dir(resumed_here)
        if cfg.checkpoint.bert_load and meta is None:  # a run --load found a checkpoint for keeps its weights
            load_pretrained_encoders(cfg.checkpoint.bert_load, self.model, self.optimizer, self.mesh, self.runner.metas, log)

        eval_samples = 0
        if cfg.logging.eval_interval > 0 and cfg.logging.eval_iters > 0:
            eval_samples = cfg.logging.eval_iters * t.global_batch_size
        going_on = meta if meta and meta["consumed_samples"] else None  # a run continued, not one started from weights
        self.sample_plan, note = plan_samples(going_on, planned_samples(t), t.seed)  # the checkpoint's order kept
        decoupled = self.decoupled_schedule.state_dict() if self.decoupled_schedule else None
        for line in (note, schedule_note(going_on and going_on.get("lr_schedule"), self.schedule.state_dict()),
                     going_on and decoupled_schedule_note(going_on.get("decoupled_lr_schedule"), decoupled)):
            if line:
                log(line)
        datasets = spec_for(cfg.model).datasets
        self.train_data, self.valid_data, _ = planned_datasets(self.sample_plan, t.seed, lambda n, seed, first: datasets(
            cfg, self.tokenizer, (n, eval_samples if first else 0, 0), seed, data_prefixes, self.vocab_size))  # fmt: skip
        if cfg.data.sft:
            parts = [*getattr(self.train_data, "datasets", [self.train_data]), self.valid_data]
            log("; ".join(ds.describe() for ds in parts if ds is not None))
        self.train_batches = self._batches(self.train_data, self.consumed_samples, cfg.data.num_workers)

        num_params = parameter_count(cfg.model, self.padded_vocab_size, cfg.data.seq_length)
        self.flops_per_token = model_flops_per_token(cfg.model, self.padded_vocab_size, cfg.data.seq_length, cfg.data.decoder_seq_length)
        bases = mfu_bases(self.device)
        self.meter = IntervalMeter(self.flops_per_token, bases, self.device)
        self.tensorboard = MetricsWriter(cfg if self.mesh.rank == 0 else None)  # TensorBoard and W&B, one writer
        self.profiler = StepProfiler(cfg.logging, cfg.checkpoint.save, self.mesh.rank, log)
        log(
            f"model: {num_params / 1e6:.2f} M parameters, vocab {self.vocab_size} ({self.padded_vocab_size} rows), {self.precision} on {self.device}; "
            f"{self.num_micro_batches} micro batches of {t.micro_batch_size} x {sample_tokens(cfg)} tokens per step; "
            f"MFU against {describe_bases(bases)}"
        )
        if t.train_samples:
            log(f"--train-samples {t.train_samples}: {t.train_iters} iterations, {self.batch_schedule.describe()}")
        if self.mesh.pp > 1:
            for line in self.runner.describe(self.num_micro_batches).splitlines():
                log(line)
        log(f"optimizer state on this rank: {self.optimizer.memory_bytes() / 2**20:.1f} MiB" if hasattr(self.optimizer, "memory_bytes") else "optimizer state: sharded by FSDP2")
        self._pending_save: PendingSave | None = None  # an --async-save checkpoint still being written
        self.host_staging = HostStaging()  # --async-save's host buffers, reused by every save of the run
        if cfg.checkpoint.async_save and cfg.checkpoint.save:  # page-locked now, not in the first save's stall
            ckpt = cfg.checkpoint
            self.host_staging.reserve(save_state(self.model, self.optimizer, self.mesh, not ckpt.no_save_optim, self.runner.metas))
            log(f"--async-save: {self.host_staging.allocated_bytes / 2**30:.2f} GiB of host memory held for checkpoint copies")
        self.last_aux: dict[str, float] = {}  # the last step's auxiliary terms, for the log line
        self.last_metrics: dict[str, float] = {}  # and the loss's metrics (the retriever's top-k accuracies)
        self.divergence = DivergenceMonitor.from_config(t, self.precision, self.mesh.rank, self.model)
        self.straggler = StragglerTimes(t.log_straggler, self.device)

    # ------------------------------------------------------------------ steps

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _batches(self, dataset, consumed_samples: int, num_workers: int = 0) -> MicroBatchIterator:
        """This data-parallel rank's micro batches (tp/cp ranks of one dp rank read the same ones)."""
        return MicroBatchIterator(dataset, self.cfg.train.micro_batch_size, consumed_samples, self.mesh.dp_rank, self.mesh.dp, num_workers=num_workers)

    def train_step(self) -> tuple[float, object]:
        """One optimizer step over a global batch; the loss is the mean over the global batch (per
        token for a language model: each micro batch's loss sum divided by the count of the whole
        batch, so gradients summed over data-parallel ranks equal the one-process gradient). The
        global batch is the batch schedule's at the samples consumed so far (it ramps up with
        --rampup-batch-size), and so is the number of micro batches."""
        loss = self.accumulate_gradients()
        # The loss and every logged term (a MoE model has two per layer) go to the host in one copy
        # started now and read after the optimizer step, whose gradient-norm read has waited for
        # it: no host sync of its own, so the host runs on into the next step while the GPU
        # still updates the weights.
        terms = {**loss.aux, **loss.metrics}
        host = _start_host_copy([loss.total / loss.count, *terms.values()])
        with self.straggler.section("optimizer"):
            self.runner.finalize_grads()
            self.host_staging.before_state_changes()  # an async save's copies of the weights are done first
            self.last_lr = self.schedule.lr_for_step(self.iteration, self.consumed_samples, self.last_batch_size)
            if self.decoupled_schedule is not None:
                self.last_decoupled_lr = self.decoupled_schedule.lr_for_step(self.iteration, self.consumed_samples, self.last_batch_size)
            result = self.optimizer.step(self.last_lr, self.last_decoupled_lr)
            self.runner.after_step()
            self.optimizer.start_param_sync()  # --overlap-param-gather: after the step's last data-parallel collective
        empty_unused_memory(self.cfg.train, 2)
        mean_loss, *values = _read_host_copy(host)
        self.last_aux = {name: values[i] for i, name in enumerate(terms) if name in loss.aux}
        self.last_metrics = {name: values[i] for i, name in enumerate(terms) if name in loss.metrics}
        return mean_loss, result

    def accumulate_gradients(self):
        """``train_step`` without its optimizer step: the global batch's forward and backward into
        zeroed gradients (``--calibrate`` times it alone: the host's launches of a step, not the
        optimizer's HBM traffic). Returns the runner's loss."""
        self.last_batch_size = self.batch_schedule.batch_at(self.consumed_samples)
        with self.straggler.section("data wait"):
            batches = [self._to_device(next(self.train_batches)) for _ in range(self.last_batch_size // self.micro_samples)]
        self._last_batches = batches  # for the divergence check's re-run
        self.optimizer.zero_grad()
        loss = self.runner.forward_backward(batches, timed=self.straggler.section if self.straggler.enabled else None)
        empty_unused_memory(self.cfg.train, 1)
        return loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over ``eval_iters`` global batches of the validation split (same batches each time)."""
        self.meter.pause()
        self.optimizer.finish_param_sync()
        self.model.eval()
        batches = self._batches(self.valid_data, 0)
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for _ in range(self.cfg.logging.eval_iters):
            loss = self.runner.forward_backward([self._to_device(next(batches)) for _ in range(self.num_micro_batches)], forward_only=True)
            total, count = total + loss.total, count + loss.count
            empty_unused_memory(self.cfg.train, 1)
        self.model.train()
        return (total / count.clamp(min=1)).item()

    def _setup_data_source_once(self) -> list[str] | None:
        """The embedded corpus is built by rank 0 first; the others then find it ready."""
        if self.mesh.rank == 0:
            prefixes = setup_data_source(self.cfg, self.log)
        if self.mesh.world_size > 1:
            dist.barrier()
        if self.mesh.rank != 0:
            prefixes = setup_data_source(self.cfg, self.log)
        return prefixes

    # ------------------------------------------------------------------ loop

    def save(self, last: bool = False) -> None:
        """A checkpoint of this iteration. A failed one keeps the previous checkpoint and, per
        --save-failure, training goes on (the next save retries) or stops; the ``last`` save of
        a run has no next one, so its failure always ends the run with an error."""
        ckpt = self.cfg.checkpoint
        if not ckpt.save:
            return
        self.meter.pause()
        save_dir = Path(ckpt.save)
        meta = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "train_samples": self.sample_plan,  # the counts the data order was drawn for (sample_plan.py)
            "config": self.cfg.to_dict(),
            "vocab_size": self.vocab_size,  # tokens; the padding is the loading run's (rows are saved cut to these)
            "tokenizer": self._tokenizer_info,
            "lr_schedule": self.schedule.state_dict(),
            "decoupled_lr_schedule": self.decoupled_schedule.state_dict() if self.decoupled_schedule else None,
        }
        self.finish_save(last)  # one checkpoint in flight at a time
        self.optimizer.finish_param_sync()  # the saved weights are this step's, gathered
        start = time.perf_counter()
        try:
            pending = start_save(str(save_dir), self.iteration, self.model, self.optimizer, meta, mesh=self.mesh,
                                 save_optim=not ckpt.no_save_optim, save_rng=not ckpt.no_save_rng, metas=self.runner.metas,
                                 in_background=ckpt.async_save, staging=self.host_staging)  # fmt: skip
            if ckpt.async_save:
                self._pending_save = pending
                self.log(f"checkpoint of iteration {self.iteration}: training stalled {time.perf_counter() - start:.2f}s "
                         f"(copy of {pending.staged_bytes / 2**20:.1f} MiB to host, overlapping the next step on a GPU); "
                         "writing in the background")  # fmt: skip
                return
            pending.finish()
        except CheckpointError as exc:
            self._save_failed(exc, last)
            return
        self.log(f"saved checkpoint at iteration {self.iteration} to {save_dir} in {time.perf_counter() - start:.2f}s")
        self._prune(self.iteration)

    def finish_save(self, last: bool = False) -> None:
        """Complete the checkpoint being written in the background, if any (collective): its
        tracker and completion marker appear only now, once every rank's files are written."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        start = time.perf_counter()
        try:
            final = pending.finish()
        except CheckpointError as exc:
            self._save_failed(exc, last)
            return
        self.log(f"saved checkpoint at iteration {pending.iteration} to {final.parent} (written in the background; "
                 f"waited {time.perf_counter() - start:.2f}s to complete it)")  # fmt: skip
        self._prune(pending.iteration)

    def _save_failed(self, exc: CheckpointError, last: bool) -> None:
        """One line, the same on every rank's verdict; raises when the run must end."""
        kept = latest_iteration(self.cfg.checkpoint.save) if self.mesh.rank == 0 else None
        kept_text = f"the newest checkpoint is still iteration {kept}" if kept is not None else "no checkpoint has been saved yet"
        if last or self.cfg.checkpoint.save_failure == "stop":
            raise CheckpointError(f"{exc}; {kept_text}") from exc
        self.log(f"warning: {exc}; {kept_text}; training goes on and the next save tries again (--save-failure stop ends the run instead)")

    def _prune(self, just_saved: int) -> None:
        if self.mesh.rank == 0 and (removed := prune(Path(self.cfg.checkpoint.save), self.cfg.checkpoint.ckpt_keep_last, just_saved)):
            self.log(f"removed the checkpoints of iterations {', '.join(map(str, removed))} (--ckpt-keep-last {self.cfg.checkpoint.ckpt_keep_last})")

    def _claim_save_dir(self, resumed_here: bool) -> SaveLock | None:
        """--save checked, locked and given the tokenizer before the first step: rank 0 decides,
        every rank raises the same error (``save_dir.py``)."""
        ckpt = self.cfg.checkpoint
        self._tokenizer_info = {"tokenizer_type": self.cfg.data.tokenizer_type}
        if not ckpt.save:
            return None
        own = state_bytes(save_state(self.model, self.optimizer, self.mesh, not ckpt.no_save_optim, self.runner.metas))
        total = torch.tensor([float(own)], dtype=torch.float64, device=self.device)
        if self.mesh.world_size > 1:
            dist.all_reduce(total)
        lock, problem = None, None
        if self.mesh.rank == 0:
            lock = SaveLock(Path(ckpt.save))
            problem, note = claim_save_dir(lock, self.iteration, resumed_here, ckpt.allow_existing_checkpoints, int(total.item()))
            if note:
                self.log(note)
            if problem is None:
                try:
                    self._tokenizer_info = self._copy_tokenizer_files(Path(ckpt.save))
                except OSError as exc:
                    problem = f"--save {ckpt.save}: cannot copy the tokenizer there: {exc}"
        if self.mesh.world_size > 1:
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem:
            if lock is not None:
                lock.release()
            raise CheckpointError(problem)
        return lock

    def _copy_tokenizer_files(self, save_dir: Path) -> dict[str, str]:
        """Put the tokenizer beside the weights so ``generate`` needs nothing else."""
        d = self.cfg.data
        info = {"tokenizer_type": d.tokenizer_type}
        target = save_dir / "tokenizer"
        if self.mesh.rank != 0:
            return info
        for key in ("tokenizer_model", "vocab_file", "merge_file"):
            source = getattr(d, key)
            if not source:
                continue
            target.mkdir(parents=True, exist_ok=True)
            source_path = Path(source)
            if source_path.is_dir():
                shutil.copytree(source_path, target / source_path.name, dirs_exist_ok=True)
            else:
                shutil.copy2(source_path, target / source_path.name)
            info[key] = f"tokenizer/{source_path.name}"
        return info

    def run(self) -> TrainResult:
        cfg, t, logc = self.cfg, self.cfg.train, self.cfg.logging
        result = TrainResult(iteration=self.iteration)
        agreement = StopAgreement(self.mesh.world_size, self.device, t.exit_duration_in_mins, self.started)
        signals = StopSignals(t.exit_signal, self.say).install()
        watchdog = self._start_watchdog()
        collection = ManualCollection(t)
        tokens_per_sample = sample_tokens(cfg)
        interval_loss, interval_steps = 0.0, 0
        try:
            collection.start()
            while self.iteration < t.train_iters:
                watchdog.enter("step", self.iteration)
                self.profiler.at(self.iteration)
                self.meter.start_step()
                with self.straggler.section("step"):
                    loss, step = self.train_step()
                self.divergence.check(self.iteration + 1, loss, step, self._rerun_last_step)
                self.meter.end_step(self.last_batch_size * tokens_per_sample // self.mesh.world_size, step.skipped)  # tokens per device
                self.iteration += 1
                collection.after_step(self.iteration)
                self.consumed_samples += self.last_batch_size
                result.losses.append(loss)
                result.grad_norms.append(step.grad_norm)
                interval_loss += loss
                interval_steps += 1
                if self.iteration % logc.log_interval == 0 or self.iteration == t.train_iters:
                    stats = self.meter.summary()
                    lr = self.last_lr
                    mean_loss = interval_loss / interval_steps
                    self.log(format_log_line(self.iteration, t.train_iters, self.consumed_samples, lr, mean_loss, step.grad_norm, step.loss_scale, stats,
                                             {**self.last_aux, **self.last_metrics}, self.last_batch_size))  # fmt: skip
                    self.tensorboard.scalars(
                        self.iteration,
                        {"train/loss": mean_loss, "train/lr": lr, "train/grad_norm": step.grad_norm, "train/loss_scale": step.loss_scale, "perf/tokens_per_s_per_device": stats["tokens_per_s"], "perf/tflops_per_device": stats["tflops_per_device"],
                         "train/batch_size": self.last_batch_size, "perf/ms_per_iter": stats["ms_per_iter"], **memory_scalars(stats),
                         **({"train/decoupled_lr": self.last_decoupled_lr} if self.last_decoupled_lr is not None else {}),
                         **{f"perf/{key}": value for key, value in stats.items() if key.startswith("mfu_")},
                         **{f"aux/{name}": value for name, value in self.last_aux.items()},
                         **{f"metrics/{name}": value for name, value in self.last_metrics.items()}},
                    )  # fmt: skip
                    interval_loss, interval_steps = 0.0, 0
                    if t.log_straggler:
                        line, scalars = report(self.straggler.gather(self.mesh.world_size), t.straggler_minmax_count)
                        self.log(line)
                        self.tensorboard.scalars(self.iteration, scalars)
                if self.valid_data is not None and logc.eval_interval > 0 and (self.iteration % logc.eval_interval == 0 or self.iteration == t.train_iters):
                    watchdog.enter("evaluation", self.iteration)
                    with collection.around_evaluation():
                        valid = self.evaluate()
                    result.valid_losses.append((self.iteration, valid))
                    self.log(f"validation at iteration {self.iteration} | loss {valid:.4f} | ppl {math.exp(min(valid, 50)):.2f}")
                    self.tensorboard.scalars(self.iteration, {"valid/loss": valid, "valid/ppl": math.exp(min(valid, 50))})
                interval_due = cfg.checkpoint.save_interval and self.iteration % cfg.checkpoint.save_interval == 0
                exit_due = t.exit_interval and self.iteration % t.exit_interval == 0
                reasons = agreement.agree(agreement.local_reasons(signals))  # every rank gets the same answer
                stopping = reasons or exit_due
                if interval_due and self.iteration < t.train_iters and not stopping:
                    watchdog.enter("save", self.iteration)
                    self.save()
                if stopping:
                    why = describe(reasons) if reasons else "--exit-interval"
                    self.log(f"stopping at iteration {self.iteration} ({why}; every rank stops and saves here)")
                    break
            agreement.close()
            self.optimizer.finish_param_sync()  # the model is whole when training ends, saved or not
            watchdog.enter("save", self.iteration)
            self.save(last=True)
            self.finish_save(last=True)
        except DivergenceError:
            self.finish_save()  # the checkpoint in flight predates the divergence: keep it (every rank stops alike)
            raise
        finally:
            collection.stop()
            watchdog.stop()
            signals.restore()
            if self.save_lock is not None:
                self.save_lock.release()
            self.tensorboard.close()
            self.profiler.close()
            self.train_batches.close()
        result.iteration = self.iteration
        if logc.generate_prompt and self.tokenizer is not None:
            result.sample = self.sample(logc.generate_prompt, logc.generate_tokens)
            self.log(f"sample: {result.sample!r}")
        return result

    def _start_watchdog(self) -> Watchdog:
        """Hang naming for the training loop (``watchdog.py``): on for several processes or when a
        limit is given. Start-up had --distributed-timeout-minutes; training gets its own."""
        t = self.cfg.train
        minutes = t.train_timeout_minutes or self.cfg.parallel.distributed_timeout_minutes
        watchdog = Watchdog(60 * minutes, t.hang_step_factor, self.mesh.rank, self.mesh.world_size, self.say)
        if self.mesh.world_size > 1 and not set_training_timeout(minutes + 1):
            self.log("note: this PyTorch cannot change a process group's timeout: training keeps --distributed-timeout-minutes")
        if self.mesh.world_size > 1 or t.train_timeout_minutes or t.hang_step_factor:
            watchdog.start()
        return watchdog

    def _rerun_last_step(self) -> object:
        """The last step's forward passes again, on the updated weights (the divergence check's locator)."""
        self.optimizer.finish_param_sync()
        return self.runner.forward_backward(self._last_batches, forward_only=True)

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        from meshtron.inference.sampling import generate

        self.optimizer.finish_param_sync()
        self.model.eval()
        ids = self.tokenizer.encode(prompt)
        out = generate(self.model, ids, max_new_tokens, temperature=0.8, top_k=40, eod=self.tokenizer.eod, generator=torch.Generator(device=self.device).manual_seed(self.cfg.train.seed))
        self.model.train()
        return prompt + self.tokenizer.decode(out)


def _silent(_: str) -> None:
    pass


def _start_host_copy(scalars: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Device scalars -> a pinned host vector being filled asynchronously (and the event that marks
    it done); on the CPU, the values at once."""
    flat = torch.stack([s.detach().float().reshape(()) for s in scalars])
    if not flat.is_cuda:
        return flat, None
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _read_host_copy(copy: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[float]:
    host, done = copy
    if done is not None:
        done.synchronize()
    return host.tolist()

