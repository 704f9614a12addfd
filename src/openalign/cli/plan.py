"""``openalign plan``: memory, FLOPs and time of a training step on a device, without the device."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from openalign.cli.options import OVERRIDES, Parser, add_config, overrides
from openalign.config import ConfigError

if TYPE_CHECKING:
    from openalign.train.plan import Plan

DEVICE_NAMES = "h100-80gb|h200-141gb|a100-40gb|a100-80gb|l4-24gb|cpu|MEM_GB"


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "plan",
        help="predict a training step's memory per device, FLOPs and time (fake tensors: no GPU, no memory)",
        build=_build,
    )


def _build(parser: Parser) -> None:
    from openalign.cli.train import train_schema

    parser.description = (
        "Build the model and one training step of a config (forward, loss over the global batch, backward, "
        "optimizer) under PyTorch's fake tensors and report, per device: parameters, gradients, optimizer state, "
        "activations, the loss's gathered buffers and the peak; FLOPs per step (PyTorch's FLOP counter, grouped "
        "convolutions corrected); time and pairs/s from a step rate measured on the device for the same model "
        "family (or, with --mfu, from the FLOPs); whether it fits, and the largest chunk size (gradient caching) "
        "that does. --train.* overrides set batch, chunk, precision, checkpointing and strategy. --validate runs "
        "small steps for real on the CPU and compares their measured peak and FLOPs with the plan's."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign plan --config pretrain_align_b7 --device h100-80gb\n"
        "  openalign plan --config pretrain_align_b7 --device a100-40gb --world-size 8 --train.chunk_size 128\n"
        "  openalign plan --config finetune_flickr30k --model.preset l2-large --device 24\n"
        "  openalign plan --validate"
    )
    parser.add_argument("--config", metavar="CONFIG", help="YAML file or packaged recipe name")
    parser.add_argument("--device", default="h100-80gb", metavar=DEVICE_NAMES, help="default h100-80gb")
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="devices (DDP or FSDP2, as --train.strategy says); default 1",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        help="override: derive the time from the FLOPs at this fraction of the device's peak FLOP/s "
        "(default: a measured step rate, or none)",
    )
    parser.add_argument("--tflops", type=float, help="the device's peak TFLOP/s in the step's precision")
    parser.add_argument(
        "--no-search", action="store_true", help="plan the given chunk size only; skip the largest-chunk search"
    )
    parser.add_argument("--row", action="store_true", help="print one Markdown table row (for docs/benchmarks.md)")
    parser.add_argument("--validate", action="store_true", help="compare plans with real CPU steps")
    add_config(parser, train_schema(), config_flag=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalign.train import plan as P

    if args.validate:
        return _validate()
    if not args.config:
        raise ConfigError("--config is required (or --validate)")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.tflops is not None and not args.tflops > 0:
        raise ConfigError(f"--tflops must be positive, got {args.tflops}")
    cfg = P.load_plan_config(args.config, overrides(args))
    device = P.device_spec(args.device)
    if args.tflops is not None:
        device = P.with_tflops(device, args.tflops)
    with P.session(cfg, device, args.world_size) as steps:
        p = P.plan(cfg, device, args.world_size, mfu=args.mfu, steps=steps)
        best = None
        if not args.no_search:
            best = P.largest_chunk(cfg, device, args.world_size, mfu=args.mfu, steps=steps)
        if args.row:
            print(_table_row(args, best[1] if best and best[1] else p, found=best))
            return 0
        for label, value in P.describe(p):
            print(f"{label:16} {value}")
        if best is not None:
            chunk, fitting = best
            if fitting is None:
                why = P.suggestion(cfg, device, args.world_size, mfu=args.mfu, steps=steps)
                print(f"{'largest chunk':16} none fits: {why}")
            elif chunk is None:
                print(f"{'largest chunk':16} no caching needed: the per-device batch of {fitting.per_rank} fits whole")
            else:
                rate = f", {fitting.pairs_per_second:,.0f} pairs/s" if fitting.pairs_per_second else ""
                rate += " at --mfu" if rate and fitting.mfu is not None else ""
                print(f"{'largest chunk':16} --train.chunk_size {chunk} (peak {P.fmt_gib(fitting.peak)}{rate})")
    return 0


def _validate() -> int:
    from openalign.train import plan

    checks = plan.validate()
    print(f"{'case':34} {'predicted':>11} {'measured':>11} {'error':>7}  FLOPs (plan = real)")
    bad = 0
    for c in checks:
        ok = abs(c.error) <= plan.TOLERANCE and c.predicted_flops == c.measured_flops
        bad += not ok
        print(
            f"{c.label:34} {c.predicted_peak / 2**20:8.1f} MiB {c.measured_peak / 2**20:8.1f} MiB {c.error:+7.1%}  "
            f"{c.predicted_flops / 1e9:.2f} GFLOP {'=' if c.predicted_flops == c.measured_flops else '!='} "
            f"{c.measured_flops / 1e9:.2f}{'' if ok else '  <- outside tolerance'}"
        )
    return 1 if bad else 0


def _table_row(args: argparse.Namespace, p: Plan, found: tuple[int | None, Plan | None] | None) -> str:
    """A Markdown row: the command, then chunk size, the planned peak and pairs/s (the largest chunk's plan),
    each beside its measured figure where the measurement is this very step, with the GPU it ran on."""
    from openalign.train import plan as P

    command = " ".join(
        [
            "openalign plan --config",
            args.config,
            "--device",
            args.device,
            "--world-size",
            str(args.world_size),
            "--row",
            *(["--no-search"] if args.no_search else []),
            *(["--mfu", str(args.mfu)] if args.mfu is not None else []),
            *_override_words(args),
        ]
    )
    if found is not None and found[1] is None:
        return f"| `{command}` | none fits | - | - | - | - |"
    chunk = "none" if p.chunk_size is None else str(p.chunk_size)
    m = p.measurement
    same = m is not None and not p.differs and p.world_size == 1
    gpu = f" ({m.gpu})" if m is not None else ""
    peak_measured = f"{m.peak_gib:.2f} GiB{gpu}" if same and m is not None and m.peak_gib else "-"
    rate_measured = f"{m.pairs_per_s:g}{gpu}" if same and m is not None else "-"
    if p.pairs_per_second is None:
        rate = f"not measured on {p.device}"
    elif p.mfu is not None:
        rate = f"{p.pairs_per_second:,.0f} (at --mfu {p.mfu:g})"
    elif same:
        rate = f"{p.pairs_per_second:,.0f}"
    else:
        assert m is not None
        shape = f"batch {m.batch}, " + (f"chunks of {m.chunk}" if m.chunk else "no chunks")
        rate = f"{p.pairs_per_second:,.0f} ({m.pairs_per_s:g}/GPU measured on {m.gpu} at {shape})"
    return f"| `{command}` | {chunk} | {P.fmt_gib(p.peak)} | {peak_measured} | {rate} | {rate_measured} |"


def _override_words(args: argparse.Namespace) -> list[str]:
    words = []
    for path, value in getattr(args, OVERRIDES, None) or []:
        words += [f"--{path}", str(value).lower() if isinstance(value, bool) else str(value)]
    return words
