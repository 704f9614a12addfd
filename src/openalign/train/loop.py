"""The training loop: ALIGN's contrastive pre-training and retrieval fine-tuning, one process or many.

``train(cfg)`` builds everything (``_Run``), then ``_Run.loop`` takes steps: next batch → the step
(``openalign.train.step``) → log, evaluate, checkpoint. Nothing else happens in between.

Non-finite guard: a step whose loss or gradient norm is NaN/Inf is skipped (no weight, optimizer or
schedule change; its batch is consumed), counted, and after ``train.max_bad_steps`` in a row the run stops
with ``NonFiniteError`` after checkpointing the last good state. A finite loss does not prove that the update
it led to was finite, so every save checks: a state with a NaN/Inf tensor is not written (one line says so)
and the checkpoints before it stay, and a non-finite final model stops the run with ``NonFiniteError``.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import yaml

from openalign.config import ConfigError, ModelConfig
from openalign.hardware import out_of_memory_figures
from openalign.model.dual_encoder import DualEncoder
from openalign.optim import build_optimizer, build_scheduler
from openalign.outputs import check_writable
from openalign.train import checkpoint as ckpt
from openalign.train.config import (
    TrainConfig,
    check_compile,
    compile_enabled,
    gpu_compile_blocker,
    gpu_computes_bfloat16,
    resolve_precision,
    sharded,
)
from openalign.train.distributed import (
    DistInfo,
    all_gather_object,
    broadcast_object,
    cleanup,
    init_distributed,
    is_distributed,
    unwrap,
    wrap_model,
)
from openalign.train.logging import METRICS_FILE, TENSORBOARD_DIR, say
from openalign.train.meter import Meter
from openalign.train.step import StepStats, TrainStep, step_loss
from openalign.train.towers import Towers, eager_towers

if TYPE_CHECKING:
    from openalign.eval.retrieval import RetrievalSet
    from openalign.text.tokenizer import TextTokenizer, Tokenizer

__all__ = ["NonFiniteError", "OutOfMemoryError", "TrainResult", "train"]

StreamFactory = Callable[..., Any]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a NaN/Inf loss or gradient."""


class OutOfMemoryError(RuntimeError):
    """The device ran out of memory; the message says where, and which settings lower the peak."""


@dataclass
class TrainResult:
    step: int  # optimizer steps taken in total (including before a resume)
    run_dir: Path
    final_dir: Path | None  # run_dir/final on rank 0 once the run reached its last step
    skipped_steps: int  # non-finite steps skipped over the whole run
    data_stats: dict[str, int] = field(default_factory=dict)  # skipped samples by reason, all ranks
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged metrics
    # Wall time of the whole run: this process's, plus what earlier processes spent up to the checkpoint it
    # resumed from (work lost after that checkpoint is counted once, when it is done again).
    seconds: float = 0.0
    precision: str = "fp32"  # what train.precision resolved to on this device (``resolve_precision``)


def train(
    cfg: TrainConfig,
    *,
    resume: str | None = None,
    stream_factory: StreamFactory | None = None,
    tokenizer: TextTokenizer | None = None,
) -> TrainResult:
    """Train as ``cfg`` says; ``resume`` is "latest" or a checkpoint directory.

    ``stream_factory`` replaces ``openalign.train.data.build_train_stream`` (same signature) and
    ``tokenizer`` the one loaded from ``data.tokenizer``. Under torchrun every process calls this.
    """
    from openalign.train.logging import check_wandb

    started = time.monotonic()
    check_wandb(cfg.log.wandb)
    owns_group = not (dist.is_available() and dist.is_initialized())
    info = init_distributed(cfg.train.device)
    if info.is_main:  # before any step, so that a run never trains for nothing
        check_writable(cfg.train.run_dir, what="train.run_dir", directory=True)
    written = _FirstWrites(cfg.train.run_dir) if info.is_main else None
    opened = _open_resume(cfg, resume, info) if resume else None
    if tokenizer is None:
        tokenizer = _load_tokenizer(cfg, opened.path if opened else None, info.is_main)
    try:
        run = _Run(cfg, info, stream_factory, tokenizer, started)
    except torch.OutOfMemoryError as err:
        raise OutOfMemoryError(_out_of_memory(cfg, info.device, None, err)) from None
    try:
        run.restore(opened)
        try:
            return run.loop()
        except KeyboardInterrupt:
            # Ctrl-C keeps the work done so far; under torchrun the other ranks are gone, so no collective save.
            if not is_distributed() and run.step > 0:
                say(f"interrupted: saving step {run.step}")
                run.save()
            raise
        except torch.OutOfMemoryError as err:
            # PyTorch's message is a paragraph of allocator figures; the run's settings are what the user changes.
            raise OutOfMemoryError(_out_of_memory(cfg, info.device, run.step + 1, err)) from None
    except BaseException:
        run.close()
        if written is not None and run.step == 0:
            written.undo()
        raise
    finally:
        run.close()
        if owns_group:
            cleanup()


def _warn(message: str) -> None:
    say(f"warning: {message}")


@dataclass
class _Resume:
    """The checkpoint every rank resumes from; rank 0 also holds what it read while choosing it."""

    path: Path
    opened: ckpt.OpenedCheckpoint | None


def _open_resume(cfg: TrainConfig, resume: str, info: DistInfo) -> _Resume | None:
    """Rank 0 resolves ``resume`` ("latest" or a directory) so every rank loads the same step (checkpoints live
    on a shared filesystem); its error, if any, is raised on every rank."""
    opened, error = None, None
    if info.is_main:
        try:
            opened = ckpt.open_checkpoint(cfg.train.run_dir, resume, log=lambda line: print(line, file=sys.stderr))
        except (FileNotFoundError, ckpt.CheckpointError) as err:
            error = (isinstance(err, FileNotFoundError), str(err))
        if opened is None and error is None:
            root = Path(cfg.train.run_dir) / ckpt.CHECKPOINT_DIR
            print(f"no checkpoint in {root}; starting at step 0", file=sys.stderr)
    path, error = broadcast_object((opened.path if opened else None, error))
    if error is not None:
        missing, message = error
        raise FileNotFoundError(message) if missing else ckpt.CheckpointError(message)
    return _Resume(path, opened) if path is not None else None


def _bad_batch_guard(max_bad: int) -> Callable[[bool, int], int]:
    bad = 0

    def update(finite: bool, step: int) -> int:
        nonlocal bad
        bad = 0 if finite else bad + 1
        if bad >= max_bad:
            raise NonFiniteError(
                f"{bad} consecutive steps had a non-finite loss or gradient (last good step {step}); "
                "lower optim.lr, set train.grad_clip, or check the data, then resume from the last checkpoint"
            )
        return bad

    return update


class _Run:
    """Everything one process needs for a run: model, optimizer, schedule, stream, logger."""

    def __init__(
        self,
        cfg: TrainConfig,
        info: DistInfo,
        stream_factory: StreamFactory | None,
        tokenizer: TextTokenizer | None,
        started: float,
    ):
        t = cfg.train
        self.cfg, self.info = cfg, info
        self.run_dir = Path(t.run_dir)
        if t.threads is not None:
            torch.set_num_threads(t.threads)
        self.tokenizer = tokenizer
        resolved = cfg.model.resolve(self.tokenizer.vocab_size if self.tokenizer is not None else None)
        # Saved models cut captions where training cut them, so evaluation and serving read what training read.
        text = dataclasses.replace(resolved.text, max_length=cfg.data.max_text_length)
        self.model_config = dataclasses.replace(resolved, text=text)
        _check_vocab(self.model_config, self.tokenizer)
        self.total_steps = cfg.total_steps
        self.per_rank = cfg.per_rank_batch(info.world_size)
        self.global_batch = self.per_rank * info.world_size
        gpu_bf16 = gpu_computes_bfloat16(info.device)  # asked once; True on a CPU
        self.precision = resolve_precision(t.precision, info.device, self.model_config.image.family, gpu_bf16=gpu_bf16)
        self.bf16 = self.precision == "bf16"
        if info.device.type == "cuda" and info.is_main and not gpu_bf16:
            _say_precision_on_an_older_gpu(info.device, t.precision, self.precision)

        torch.manual_seed(t.seed)  # the same initial weights on every rank
        model = DualEncoder(self.model_config)
        if cfg.model.init is not None:
            _load_init(model, cfg.model.init)
        for tower in ("image", "text"):
            source = getattr(cfg.model, f"init_{tower}")
            if source is not None:
                _load_tower(model, tower, source, info.is_main)
            if getattr(cfg.model, f"lock_{tower}"):
                # Before wrapping and before the optimizer: DDP and the optimizer see only trainable parameters.
                model.lock_tower(tower)
        if t.grad_checkpointing:
            model.set_grad_checkpointing(True)
        if self.precision == "bf16-image" and t.precision == "auto" and info.is_main:
            # Said once: the same seed's figures differ from an fp32 run's (within the spread of seeds).
            print(
                "precision auto: the image tower computes in bf16 on this AMX CPU (train.precision fp32 "
                "keeps it in fp32)",
                file=sys.stderr,
            )
        model.to(info.device).train()
        check_compile(cfg, info.world_size, info.device)  # asks the GPU only when train.compile is true
        blocker = gpu_compile_blocker(info.device) if t.compile is None else None
        self.compiled = compile_enabled(cfg, info.device, info.world_size, gpu_compiles=blocker is None)
        if blocker is not None and info.is_main:
            print(f"train.compile: eager, as {blocker}", file=sys.stderr)
        self.fsdp = sharded(cfg, info.world_size)
        image_dtype = torch.bfloat16 if self.precision == "bf16-image" else None
        self.towers = Towers(
            model, device=info.device, compiled=self.compiled, image_dtype=image_dtype, sharded=self.fsdp
        )
        self.model = model
        self.wrapped = wrap_model(model, info, t.strategy, bf16=self.bf16)
        self.optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim)
        # Ranks draw different dropout masks; restored from the checkpoint on resume.
        torch.manual_seed(t.seed * 1_000_003 + info.rank + 1)

        from openalign.train.data import build_train_stream, pin_batches

        data_cfg = dataclasses.replace(cfg.data, batch_size=self.per_rank)
        data_cfg.pin_memory = pin_batches(data_cfg, info.device, self.model_config)
        if stream_factory is None:
            stream_factory = build_train_stream
        self.stream = stream_factory(
            data_cfg,
            self.tokenizer,
            rank=info.rank,
            world_size=info.world_size,
            seed=t.seed,
            model_config=self.model_config,
        )
        self.step = 0
        self.skipped_steps = 0
        self.last_checkpoint_time = time.monotonic()
        self.started = started  # when train() was called: this process's share of the run's time
        self.seconds_before = 0.0  # spent by the processes before a resume
        self.meter = Meter(self.global_batch, 0)
        self.logger: Any = None
        self.eval_set: Any = None

    # ------------------------------------------------------------------ state

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Full (unsharded) model and optimizer state; a collective under FSDP, valid on rank 0."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_state_dict(self.model, self.optimizer, options=options)
        return self.model.state_dict(), self.optimizer.state_dict()

    def save(self) -> Path | None:
        """Checkpoint the current step. Every rank must call it; rank 0 writes, and returns the path unless the
        state held a non-finite tensor (then nothing is written)."""
        rng = all_gather_object(ckpt.capture_rng(self.info.device))
        streams = all_gather_object(self.stream.state_dict())
        model_state, optim_state = self._state_dicts()
        path = None
        if self.info.is_main:
            state = {
                "step": self.step,
                "world_size": self.info.world_size,
                "optimizer": optim_state,
                "scheduler": self.scheduler.state_dict(),
                "rng": rng,
                "stream": streams,
                "skipped_steps": self.skipped_steps,
                "seconds": self.seconds(),
                "global_batch": self.global_batch,
                "config": self.cfg.to_dict(),
            }
            try:
                path = ckpt.write_checkpoint(
                    self.run_dir,
                    self.step,
                    model_config=self.model_config,
                    model_state=model_state,
                    trainer_state=state,
                    tokenizer=self.tokenizer,
                    keep=self.cfg.train.keep_checkpoints,
                )
            except ckpt.CheckpointError as err:
                say(f"checkpoint not written, the previous ones are kept: {err}")
        if is_distributed():
            dist.barrier()
        self.last_checkpoint_time = time.monotonic()
        return path

    def restore(self, resume: _Resume | None) -> None:
        if resume is None:
            return
        path = resume.path
        if resume.opened is not None:
            trainer, model_state = resume.opened.trainer, resume.opened.model
            resume.opened = None  # its tensors are copied into the model below; don't keep a second copy
        else:
            trainer, model_state = ckpt.load_trainer_state(path)
        state: dict[str, Any] = model_state
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            options = StateDictOptions(full_state_dict=True)
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state,
                optim_state_dict=trainer["optimizer"],
                options=options,
            )
        else:
            try:
                self.model.load_state_dict(model_state)
            except RuntimeError as err:
                raise ConfigError(f"{path}: checkpoint does not fit the configured model: {str(err)[:300]}") from None
            try:
                self.optimizer.load_state_dict(trainer["optimizer"])
            except ValueError as err:
                raise ConfigError(
                    f"{path}: the optimizer state does not fit the trainable parameters ({err}); was the run "
                    "started with other model.lock_image / model.lock_text settings?"
                ) from None
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.step = int(trainer["step"])
        self.skipped_steps = int(trainer.get("skipped_steps", 0))
        self.seconds_before = float(trainer.get("seconds", 0.0))
        rank, saved_world = self.info.rank, int(trainer["world_size"])
        streams = trainer["stream"]
        if saved_world == self.info.world_size:
            self.stream.load_state_dict(streams[rank])
            ckpt.restore_rng(trainer["rng"][rank], self.info.device)
        else:
            # The position is global, so any rank's record of it serves; the skip counts are summed once.
            state = dict(streams[0])
            if "stats" in state:
                totals: dict[str, int] = {}
                for s in streams:
                    for reason, n in (s.get("stats") or {}).items():
                        totals[reason] = totals.get(reason, 0) + n
                state["stats"] = totals if rank == 0 else {}
            self.stream.load_state_dict(state)
            saved = trainer["rng"]
            if rank < len(saved):
                ckpt.restore_rng(saved[rank], self.info.device)
            else:
                torch.manual_seed(self.cfg.train.seed * 1_000_003 + rank + 1 + self.step)
        if self.info.is_main:
            print(f"resumed from {path} at step {self.step}", file=sys.stderr)
            self._warn_batch_change(trainer, saved_world)

    def _warn_batch_change(self, trainer: dict[str, Any], saved_world: int) -> None:
        saved = _saved_global_batch(trainer, saved_world)
        if saved is None or saved == self.global_batch:
            return
        _warn(
            f"the global batch changes from {saved} (checkpoint) to {self.global_batch}: the data stream goes on "
            f"at the sample it had reached, but the schedule counts steps, so from step {self.step} on each step "
            f"reads {self.global_batch / saved:.3g}× the samples it did and the {self.total_steps - self.step} "
            f"steps left read {(self.total_steps - self.step) * self.global_batch} samples instead of "
            f"{(self.total_steps - self.step) * saved}"
        )

    # ------------------------------------------------------------------ the loop

    def loop(self) -> TrainResult:
        cfg, info = self.cfg, self.info
        if info.is_main:
            # Where and how the run computes, before any step: a GPU left unseen (a driver too old for this
            # PyTorch) would otherwise show only as a slow run on the CPU.
            print(self.summary(), file=sys.stderr)
        self.logger = _make_logger(cfg, info, self.total_steps, self.step)
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        step, guard = self._train_step(), _bad_batch_guard(cfg.train.max_bad_steps)
        meter = self.meter = Meter(self.global_batch, self.step)
        metrics: dict[str, float] = {}
        batches = iter(self.stream)
        small_data_warned = info.is_main and self._warn_small_shards()
        # The first step compiles the towers' graphs: its time is reported once, and left out of the rate.
        compiling = self.compiled
        while self.step < self.total_steps:
            batch = meter.next(batches)
            if not small_data_warned and info.is_main:
                small_data_warned = self._warn_small_epoch()
            if compiling:
                # Minutes on a large model with nothing else on screen: said first, not to be taken for a hang.
                self.logger.say("compiling the towers (once, in the first step) ...")
            began = time.perf_counter()
            stats = step(batch, self._checkpoint_due())
            if compiling:
                compiling = False
                self.logger.say(f"compiled towers in {time.perf_counter() - began:.1f} s (first step)")
                meter.start(self.step + 1)
            if not stats.finite:
                self._skip_step(guard)
                continue
            guard(True, self.step)
            self.step += 1
            if self.step % cfg.log.every == 0 or self.step == self.total_steps:
                metrics = self._log(stats)
            with meter.paused():
                self._between_steps(stats.checkpoint_due)
        return self._finish(metrics)

    def _train_step(self) -> TrainStep:
        t = self.cfg.train
        loss_fn = step_loss(t)
        return TrainStep(
            self.wrapped,
            self.towers,
            self.optimizer,
            self.scheduler,
            loss_fn,
            self.info.device,
            world_size=self.info.world_size,
            chunk_size=t.chunk_size,
            grad_clip=t.grad_clip,
            pixels=self.stream.pixels,
            bf16=self.bf16,
            fsdp=self.fsdp,
        )

    def _checkpoint_due(self) -> bool:
        """Rank 0's clock says a checkpoint is due (``train.checkpoint_minutes``); the step tells every rank."""
        minutes = self.cfg.train.checkpoint_minutes
        return self.info.is_main and minutes > 0 and time.monotonic() - self.last_checkpoint_time >= 60 * minutes

    def _log(self, stats: StepStats) -> dict[str, float]:
        metrics = {
            "loss": stats.loss,
            "temperature": stats.temperature,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "skipped_steps": self.skipped_steps,
            "samples_seen": (self.step + self.skipped_steps) * self.global_batch,
            **self.meter.window(self.step),
        }
        self.logger.log(self.step, metrics)
        return metrics

    def _between_steps(self, checkpoint_due: bool) -> None:
        """Evaluate and checkpoint when due; never after the last step, which ``_finish`` saves."""
        cfg, t = self.cfg, self.cfg.train
        if cfg.eval.every and (self.step % cfg.eval.every == 0 or self.step == self.total_steps):
            self._evaluate()
        if self.step < self.total_steps and (
            (t.checkpoint_every and self.step % t.checkpoint_every == 0) or checkpoint_due
        ):
            self.save()

    def summary(self) -> str:
        """One line: steps, global batch, devices, precision, compiled or eager, chunks."""
        t, info = self.cfg.train, self.info
        if info.device.type == "cuda":
            name = torch.cuda.get_device_name(info.device)
            where = f"{info.world_size} x {name}" if info.world_size > 1 else f"{name} ({info.device})"
        else:
            threads = f"{torch.get_num_threads()} thread" + ("s" if torch.get_num_threads() > 1 else "")
            where = f"{info.world_size} CPU processes of {threads}" if info.world_size > 1 else f"the CPU ({threads})"
        how = [self.precision, "compiled" if self.compiled else "eager"]
        if info.world_size > 1:
            how.append(t.strategy)
        if t.chunk_size is not None:
            how.append(f"chunks of {t.chunk_size}")
        steps = f"steps {self.step + 1}-{self.total_steps}" if self.step else f"{self.total_steps} steps"
        return f"training {steps} of {self.global_batch} pairs on {where}: {', '.join(how)}"

    def _warn_small_shards(self) -> bool:
        """Before step 1: warn when the samples the shards record (their ``_stats.json`` or Parquet tables) sum
        to fewer than the global batch; True once warned. Shards without such records say nothing here."""
        recorded = getattr(self.stream, "recorded_length", None)
        count = recorded(self.global_batch) if recorded is not None else None
        if count is None or self.global_batch <= count:
            return False
        _warn(
            f"the global batch of {self.global_batch} is larger than the {count} samples the shards record: "
            + (
                f"each pair appears ~{self.global_batch / count:.1f} times per batch, so in-batch negatives "
                "include copies of the positive; lower train.batch_size or train on more pairs"
                if count
                else "there is nothing to train on"
            )
        )
        return True

    def _warn_small_epoch(self) -> bool:
        """Warn when the global batch holds more pairs than an epoch; True once warned. A source whose epoch
        length is unknown (an endless one, or shards not yet read to their end) says nothing yet."""
        length = getattr(self.stream, "epoch_length", None)
        if not length or self.global_batch <= length:
            return False
        _warn(
            f"the global batch of {self.global_batch} is larger than the {length} pairs of an epoch: each pair "
            f"appears ~{self.global_batch / length:.1f} times per batch, so in-batch negatives include copies of "
            "the positive; lower train.batch_size or train on more pairs"
        )
        return True

    def _skip_step(self, guard: Callable[..., int]) -> None:
        """Count a non-finite step (the step took no update); abort after too many in a row."""
        self.skipped_steps += 1
        try:
            guard(False, self.step)
        except NonFiniteError as err:
            # Usually the weights are still the last good ones: keep them for a resume with a lower lr. When the
            # last finite step's update was itself non-finite, the save refuses and the older checkpoints stay.
            if self.save() is None and self.info.is_main:
                raise NonFiniteError(
                    f"{err} (the state after step {self.step} is not finite either, so that is an earlier one)"
                ) from None
            raise

    def _evaluate(self) -> None:
        if not (self.info.is_main or self.fsdp):
            return
        if self.eval_set is None:
            self.eval_set = _load_eval_set(self.cfg)
        from openalign.eval.retrieval import evaluate_retrieval

        if self.tokenizer is None:
            raise ValueError("evaluation needs a tokenizer; set data.tokenizer")
        model = cast("DualEncoder", unwrap(self.wrapped))
        # Evaluation leaves the random stream alone, or a resumed run would diverge from a straight one. It runs
        # eager: its batches, captions and modes differ from training's, so compiled towers would compile again.
        with eager_towers():
            result = evaluate_retrieval(
                model,
                self.tokenizer,
                self.eval_set,
                batch_size=self.cfg.eval.batch_size,
                device=str(self.info.device),
                progress=False,
            )
        model.train()
        if self.info.is_main:
            self.logger.log(self.step, {f"eval/{k}": float(v) for k, v in result.items()})

    def _finish(self, metrics: dict[str, float]) -> TrainResult:
        self.save()
        stats = _reduce_stats(getattr(self.stream, "stats", {}) or {})
        final = None
        model_state, _ = self._state_dicts() if self.fsdp else (self.model.state_dict(), None)
        if self.info.is_main:
            try:
                final = ckpt.write_model(self.run_dir / "final", self.model_config, model_state, self.tokenizer)
            except ckpt.CheckpointError as err:
                raise NonFiniteError(
                    f"final model not written: {err}; lower optim.lr or set train.grad_clip, then resume from the "
                    "last checkpoint"
                ) from None
            if stats:
                self.logger.log(self.step, {f"skipped/{k}": v for k, v in stats.items()})
            share = self.meter.data_wait_share()
            waits = "" if share is None else f"; waited for data {share:.1%} of the training time"
            self.logger.say(
                f"finished {self.step} steps; model in {final}; {self.skipped_steps} non-finite steps skipped; "
                f"samples skipped: {dict(stats) or 'none'}{waits}"
            )
        return TrainResult(
            self.step, self.run_dir, final, self.skipped_steps, dict(stats), metrics, self.seconds(), self.precision
        )

    def seconds(self) -> float:
        return self.seconds_before + time.monotonic() - self.started

    def close(self) -> None:
        """Closes the logger and lets go of the data-parallel wrapper, whose reducer must not outlive the process
        group's Python handle (``distributed.cleanup`` says why)."""
        if self.logger is not None:
            self.logger.close()
        self.wrapped = self.model


# ---------------------------------------------------------------------------------------------- helpers


class _FirstWrites:
    """What a run writes into ``run_dir`` before its first step, taken back when it fails before that step: a
    failed start then leaves the folder as it was, and the next run is not taken for a resumed one."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.new_dir = not self.run_dir.exists()
        self.new = [n for n in ("config.yaml", METRICS_FILE, TENSORBOARD_DIR) if not (self.run_dir / n).exists()]

    def undo(self) -> None:
        if self.new_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return
        for name in self.new:
            path = self.run_dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _out_of_memory(cfg: TrainConfig, device: torch.device, step: int | None, err: BaseException) -> str:
    """One line for a run the device's memory could not hold (in ``step``, or None: while the model was set up):
    what was asked for, the peak and capacity on a GPU, the settings that lower the peak, and the checkpoint a
    resume would start from."""
    t = cfg.train
    asked = out_of_memory_figures(str(err))[0]
    where = f"in step {step}" if step is not None else "while the model was set up"
    said = f"out of {'GPU' if device.type == 'cuda' else device.type} memory {where}"
    if asked:
        said += f" (allocating {asked})"
    if device.type == "cuda":
        gib = 1024**3
        total = torch.cuda.get_device_properties(device).total_memory / gib
        said += f"; peak {torch.cuda.max_memory_allocated(device) / gib:.1f} GiB of {total:.1f}"
    if step is None:
        # Weights alone: no batch setting helps, sharding them does.
        advice = "the model does not fit one device: train.strategy fsdp shards it across the GPUs of a torchrun"
    else:
        fixes = [
            f"lower train.chunk_size (now {t.chunk_size})"
            if t.chunk_size is not None
            else "set train.chunk_size (gradient caching: the same batch, that many pairs at a time)"
        ]
        if not t.grad_checkpointing:
            fixes.append("set train.grad_checkpointing true")
        advice = f"{' or '.join(fixes)}; `openalign plan --config CONFIG --device GPU` names a chunk size that fits"
    saved = ckpt.list_checkpoints(t.run_dir)
    kept = f"; the checkpoint of step {saved[-1][0]} is kept (--resume latest)" if saved else ""
    return f"{said}: {advice}{kept}"


def _say_precision_on_an_older_gpu(device: torch.device, asked: str, precision: str) -> None:
    """One line on a GPU without bfloat16 hardware: what auto chose there, or that the bf16 asked for is emulated."""
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    why = f"the {name} (compute capability {major}.{minor}) has no bfloat16 hardware"
    if asked == "auto":
        print(f"precision auto: fp32, as {why}", file=sys.stderr)
    elif precision != "fp32":
        _warn(
            f"train.precision {precision}: {why}, so its bf16 is emulated, slower than fp32, and cuDNN may have no "
            "bf16 convolutions for it; train.precision auto or fp32 computes in fp32"
        )


def _saved_global_batch(trainer: dict[str, Any], saved_world: int) -> int | None:
    if "global_batch" in trainer:
        return int(trainer["global_batch"])
    # Checkpoints written before the global batch was recorded: their config says it.
    train = (trainer.get("config") or {}).get("train") or {}
    if train.get("batch_size") is not None:
        return int(train["batch_size"])
    per_rank = ((trainer.get("config") or {}).get("data") or {}).get("batch_size")
    return int(per_rank) * saved_world if per_rank is not None else None


def _reduce_stats(stats: Any) -> dict[str, int]:
    from openalign.train.data import reduce_stats

    return dict(reduce_stats(dict(stats)))


def _has_tokenizer(path: str | Path) -> bool:
    from openalign.data.sources import find_tokenizer_file

    return Path(path).is_dir() and find_tokenizer_file(path) is not None


def _load_tokenizer(cfg: TrainConfig, resume: Path | None, is_main: bool) -> TextTokenizer | None:
    """The run's tokenizer: ``data.tokenizer``, the ``model.init`` (else ``model.init_text``) checkpoint's, or
    (synthetic data) a vocabulary learnt from the world's captions. A learnt one is learnt once, by rank 0, and
    handed to every rank; a resumed run takes the one saved with the checkpoint ``resume`` it continues from.
    Learning it again is not safe: the WordPiece trainer breaks ties between equally frequent merges in hash-map
    order, so two learners can disagree."""
    from openalign.text import load_tokenizer

    length = cfg.data.max_text_length
    if cfg.data.tokenizer:
        return load_tokenizer(cfg.data.tokenizer, max_length=length)
    for init in (cfg.model.init, cfg.model.init_text):
        if init is not None and _has_tokenizer(init):
            return load_tokenizer(init, max_length=length)
    if cfg.data.source != "synthetic":
        return None
    tokenizer = None
    if is_main:
        if resume is not None and _has_tokenizer(resume):
            tokenizer = load_tokenizer(resume, max_length=length)
        else:
            tokenizer = _synthetic_tokenizer(cfg)
    shared: TextTokenizer | None = broadcast_object(tokenizer)
    return shared


def _synthetic_tokenizer(cfg: TrainConfig, captions: int = 10_000) -> Tokenizer:
    """A WordPiece vocabulary learnt from the synthetic world's captions (noise included), as
    ``openalign vocab`` would. Captions in other languages than English keep their case and accents:
    BERT-uncased normalisation strips accents, which folds words that differ only by them together (French
    "a"/"à", Czech "byt"/"být")."""
    from openalign.data.synthetic import SyntheticWorld
    from openalign.text import train_wordpiece

    seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
    syn = cfg.data.synthetic
    world = SyntheticWorld(seed, syn.image_size, syn.languages)
    texts = (row.caption for row in world.iter_rows(captions, syn.noise))
    tokenizer = train_wordpiece(texts, vocab_size=8192, lowercase=tuple(syn.languages) == ("en",))
    tokenizer.max_length = cfg.data.max_text_length
    return tokenizer


def _check_vocab(config: ModelConfig, tokenizer: TextTokenizer | None) -> None:
    if tokenizer is not None and tokenizer.vocab_size > config.text.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's text.vocab_size is "
            f"{config.text.vocab_size}; use the model's own tokenizer (data.tokenizer)"
        )


def _load_init(model: DualEncoder, init: str) -> None:
    """Start from a pre-trained checkpoint (openalign or transformers AlignModel directory)."""
    from openalign.model.io import load_model

    source = load_model(init)
    try:
        model.load_state_dict(source.state_dict())
    except RuntimeError as err:
        raise ConfigError(f"model.init {init}: its weights do not fit the configured model: {str(err)[:300]}") from None


def _load_tower(model: DualEncoder, tower: str, path: str, is_main: bool) -> None:
    """One tower and its projection, weights and batch-norm statistics, from a checkpoint; the rest of ``model``
    is left as it is. The tower's shapes must be the configured ones."""
    from openalign.model.io import first_mismatch, load_model

    source = load_model(path)
    prefixes = DualEncoder.tower_prefixes(tower)
    want = {k: v for k, v in model.state_dict().items() if k.startswith(prefixes)}
    got = {k: v for k, v in source.state_dict().items() if k.startswith(prefixes)}
    problem = first_mismatch(want, got)
    if problem is not None:
        raise ConfigError(f"model.init_{tower} {path}: its {tower} tower does not fit the configured model: {problem}")
    model.load_state_dict(got, strict=False)
    # Same shapes, different arithmetic: the features would not be the ones the tower was trained to give.
    ours, theirs = (getattr(c, tower) for c in (model.config, source.config))
    for key in ("padding", "pooling"):
        if is_main and getattr(ours, key, None) != getattr(theirs, key, None):
            _warn(
                f"model.init_{tower} {path} uses {tower}.{key}={getattr(theirs, key)!r} but the model is configured "
                f"with {getattr(ours, key)!r}; set --model.{tower}.{key} {getattr(theirs, key)} to keep its features"
            )


def _make_logger(cfg: TrainConfig, info: DistInfo, total_steps: int, start_step: int) -> Any:
    from openalign.train.logging import RunLogger

    kwargs = cfg.log.logger_kwargs(start_step)
    if kwargs["wandb"] is not None:
        kwargs["wandb"]["config"] = cfg.to_dict()
    logger, error = None, None
    try:
        logger = RunLogger(cfg.train.run_dir, info.is_main, total_steps, **kwargs)
    except ConfigError as err:  # only the main rank logs, so only it can fail; the others must not wait for it
        error = str(err)
    error = broadcast_object(error)
    if error is not None:
        if logger is not None:
            logger.close()
        raise ConfigError(error)
    return logger


def _load_eval_set(cfg: TrainConfig) -> RetrievalSet:
    from openalign.eval.retrieval import RetrievalSet

    e = cfg.eval
    if e.source == "karpathy":
        from openalign.eval.datasets import load_karpathy

        data = load_karpathy(e.karpathy, e.image_root or Path(e.karpathy).parent, e.split)
        if len(data.images) <= e.images:
            return data
        # The first eval.images images and their captions: a cheap, fixed check between steps.
        keep = [j for j, i in enumerate(data.text_image_ids) if i < e.images]
        images = [image for _, image in zip(range(e.images), data.images, strict=False)]
        captions = [data.captions[j] for j in keep]
        return RetrievalSet(images, captions, [data.text_image_ids[j] for j in keep], name=data.name)
    from openalign.data.synthetic import retrieval_set

    # Scenes drawn at the size the synthetic training stream draws them, so the held-out set looks like training.
    images, captions, ids = retrieval_set(e.images, e.captions_per_image, image_size=cfg.data.synthetic.image_size)
    return RetrievalSet(images, captions, ids)
