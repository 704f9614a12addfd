"""Exact resume after kill -9, resume on another world size, two torchrun "nodes", FSDP2.

Run as a script, this file is the training process the tests start, kill and restart:
``python test_train_resume.py RUN_DIR MODE`` (see ``main``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dist_utils import run_gloo  # noqa: E402
from openalign.cli import main as cli_main  # noqa: E402
from openalign.model.dual_encoder import DualEncoder  # noqa: E402
from openalign.train.checkpoint import CheckpointError, list_checkpoints, load_trainer_state  # noqa: E402
from openalign.train.loop import train  # noqa: E402
from test_train_loop import NO_DROPOUT, factory, tiny_config  # noqa: E402


def resume_config(run_dir: Path | str) -> Any:
    # Dropout and stochastic depth on: resuming must restore the random stream, not just the weights.
    return tiny_config(
        run_dir,
        optim={"warmup_steps": 5, "total_steps": 20},
        train={"checkpoint_every": 10, "keep_checkpoints": 5},
        log={"tensorboard": False, "progress": False},
    )


def ddp_config(
    run_dir: Path | str,
    strategy: str = "ddp",
    steps: int = 3,
    optim: dict | None = None,
    group: int = 8,
    chunk: int | None = None,
) -> Any:
    """Global batch 16 in ghost-BN groups of ``group`` and no dropout: two ranks of 8 compute exactly what one
    process of 16 computes, so multi-process runs can be compared with a single-process one."""
    model = {**NO_DROPOUT, "image": {"drop_connect_rate": 0.0, "batch_norm": "virtual", "virtual_batch_size": group}}
    return tiny_config(
        run_dir,
        model=model,
        optim=optim or {"name": "sgd", "lr": 0.01, "schedule": "constant", "warmup_steps": 0, "total_steps": 20},
        train={"batch_size": 16, "steps": steps, "strategy": strategy, "checkpoint_every": 2, "chunk_size": chunk},
        log={"tensorboard": False, "progress": False},
    )


def main(argv: list[str]) -> None:
    """MODE: ``straight`` (20 steps), ``killable`` (hangs after 11 batches, to be killed), ``resume``
    (resume latest, to step 20), ``node`` (a torchrun process of the two-node test)."""
    torch.set_num_threads(1)
    run_dir, mode = Path(argv[0]), argv[1]
    if mode == "node":
        # torchrun starts its worker in a session of its own, which killing the node does not reach: a worker that
        # hangs prints where it is and leaves, within the test's limit.
        faulthandler.dump_traceback_later(180, exit=True)
        threads = len(os.listdir("/proc/self/task"))
        result = train(ddp_config(run_dir), stream_factory=factory(blocked=True))
        rank = int(os.environ["RANK"])
        # Threads the run left behind: the process group's must be joined before the interpreter exits.
        left = len(os.listdir("/proc/self/task")) - threads
        (run_dir / f"node{rank}.json").write_text(
            json.dumps({"world_size": int(os.environ["WORLD_SIZE"]), "step": result.step, "threads_left": left})
        )
        return
    make = factory(block_after=11) if mode == "killable" else factory()
    train(resume_config(run_dir), resume="latest" if mode == "resume" else None, stream_factory=make)


def _script(run_dir: Path, mode: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), str(run_dir), mode]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_kill_9_and_resume_is_bitwise_equal_to_a_straight_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The straight run goes alongside the one to be killed.
    straight = subprocess.Popen(_script(tmp_path / "straight", "straight"), env=env, stderr=subprocess.PIPE)
    proc: subprocess.Popen[bytes] | None = None
    try:
        killed_dir = tmp_path / "killed"
        proc = subprocess.Popen(
            _script(killed_dir, "killable"), env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 120
        while not list_checkpoints(killed_dir):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no step-10 checkpoint within 120 s"
            time.sleep(0.1)
        time.sleep(0.5)  # let it get into step 11: the kill lands mid-run, after the checkpoint
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        assert [s for s, _ in list_checkpoints(killed_dir)] == [10]
        assert not (killed_dir / "final").exists()

        resumed = subprocess.run(_script(killed_dir, "resume"), env=env, capture_output=True, timeout=120)
        assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
        assert "resumed from" in resumed.stderr.decode()

        _, straight_err = straight.communicate(timeout=120)
        assert straight.returncode == 0, straight_err.decode()[-2000:]
        a, b = _weights(tmp_path / "straight" / "final"), _weights(killed_dir / "final")
        assert a.keys() == b.keys()
        different = [k for k in a if not torch.equal(a[k], b[k])]
        assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
        # Optimizer state too: the next step would also be identical.
        sa, _ = load_trainer_state(tmp_path / "straight" / "checkpoints" / "step_0000020")
        sb, _ = load_trainer_state(killed_dir / "checkpoints" / "step_0000020")
        for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True):
            assert torch.equal(pa["exp_avg"], pb["exp_avg"]) and torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])
        assert sa["scheduler"] == sb["scheduler"] and sa["stream"] == sb["stream"]
    finally:
        for child in (straight, proc):
            if child is not None and child.poll() is None:
                child.kill()


# ------------------------------------------------------------------------------ world size 2 -> 1


def _locked_image(cfg: Any) -> Any:
    cfg.model.lock_image = True
    return cfg


def _two_rank_run(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    make = factory()
    # A locked image tower under DDP: only the text tower and temperature get (all-reduced) gradients.
    result = train(_locked_image(ddp_config(run_dir, steps=4)), stream_factory=make)
    return {"step": result.step, "position": make.built[0].position, "first": make.built[0].seen[:2]}


@pytest.mark.slow
def test_resume_on_a_different_world_size_continues_at_the_right_sample(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (tmp_path / "gloo").mkdir()
    results = run_gloo(_two_rank_run, 2, tmp_path / "gloo", str(run_dir))
    # Rank r reads samples r, r+2, ... of each global batch of 16.
    assert [r["first"] for r in results] == [[0, 16], [1, 17]]
    assert all(r["step"] == 4 and r["position"] == 64 for r in results)
    state, _ = load_trainer_state(run_dir / "checkpoints" / "step_0000004")
    assert state["world_size"] == 2 and len(state["stream"]) == 2 and len(state["rng"]) == 2
    torch.manual_seed(0)
    start = DualEncoder(ddp_config(run_dir).model.resolve()).state_dict()
    trained = _weights(run_dir / "checkpoints" / "step_0000004")
    image = [k for k in start if k.startswith(("image.", "image_proj."))]
    assert any(k.endswith("running_var") for k in image)
    assert all(torch.equal(trained[k], start[k]) for k in image)
    assert not torch.equal(trained["text_proj.weight"], start["text_proj.weight"])

    make = factory()
    result = train(_locked_image(ddp_config(run_dir, steps=6)), resume="latest", stream_factory=make)
    stream = make.built[0]
    assert result.step == 6
    assert stream.seen == [64, 80]  # one process now reads whole global batches, from sample 64 on
    assert stream.batch == 16


# ------------------------------------------------------------------------------ two torchrun "nodes"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_nodes(commands: list[list[str]], logs: list[Path], env: dict[str, str], timeout: float) -> list[int]:
    """Runs the commands side by side; returns their exit codes once all have ended or one has failed.

    stderr goes to files: a pipe nobody reads can fill and stall a node. Both nodes are watched at once, so a node that
    fails ends the run instead of leaving the other waiting in a collective. Each node is its own process group, so
    its torchrun workers go with it when it is killed."""
    with contextlib.ExitStack() as stack:
        procs = [
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=stack.enter_context(log.open("wb")),
                start_new_session=True,
            )
            for command, log in zip(commands, logs, strict=True)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
                assert time.monotonic() < deadline, f"no finish within {timeout:.0f} s\n" + _tails(logs)
                time.sleep(0.2)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [p.returncode for p in procs]


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in logs)


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_one_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "nodes"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def node_command(node: int, port: int) -> list[str]:
        rendezvous = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"]
        rendezvous += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *rendezvous,
            str(Path(__file__).resolve()),
            str(run_dir),
            "node",
        ]

    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    for _ in range(3):  # the free port can be taken by another program before node 0 binds it: pick another
        port = _free_port()
        codes = _run_nodes([node_command(n, port) for n in (0, 1)], logs, env, timeout=240)
        if codes == [0, 0] or "address already in use" not in _tails(logs).lower():
            break
    assert codes == [0, 0], _tails(logs)
    nodes = [json.loads((run_dir / f"node{r}.json").read_text()) for r in (0, 1)]
    assert all(n == {"world_size": 2, "step": 3, "threads_left": 0} for n in nodes)

    torch.set_num_threads(1)
    # Each node's contiguous half of the global batch is one ghost-BN group of the single process's batch.
    single = train(ddp_config(tmp_path / "single"), stream_factory=factory(blocked=True))
    a, b = _weights(run_dir / "final"), _weights(single.final_dir)
    assert a.keys() == b.keys()
    # Parameters only: running statistics are rank 0's (its half of the batch), by design of DDP's buffers.
    for k in (k for k in a if "running" not in k and "num_batches" not in k):
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------------ FSDP2


# eps 1e-3: several biases have an exactly-zero true gradient (a batch norm downstream cancels them), and with
# the usual 1e-6 Adam-style normalisation would turn their rounding noise into steps of random sign.
LAMB = {"name": "lamb", "lr": 1e-3, "eps": 1e-3, "schedule": "constant", "warmup_steps": 0, "total_steps": 20}


def _fsdp_run(rank: int, world: int, run_dir: str) -> None:
    config = ddp_config(run_dir, strategy="fsdp", steps=2, optim=LAMB, group=4, chunk=4)
    train(config, stream_factory=factory(blocked=True))


@pytest.mark.slow
def test_fsdp2_matches_single_process_training_on_cpu(tmp_path: Path) -> None:
    """Sharded parameters, gradients and LAMB state (its per-tensor trust ratio needs whole-tensor norms of
    sharded tensors), the unsharded temperature's averaged gradient, gradient caching without a reduction
    per chunk, and gathered checkpoints."""
    (tmp_path / "gloo").mkdir()
    run_gloo(_fsdp_run, 2, tmp_path / "gloo", str(tmp_path / "fsdp"))
    torch.set_num_threads(1)
    # Plain training of the whole batch in ghost-BN groups of 4 = FSDP ranks with gradient caching in chunks of 4.
    config = ddp_config(tmp_path / "single", steps=2, optim=LAMB, group=4)
    single = train(config, stream_factory=factory(blocked=True))
    a, b = _weights(single.final_dir), _weights(tmp_path / "fsdp" / "final")
    assert a.keys() == b.keys()
    # Rounding differs (chunked sums, sharded reductions) and LAMB's per-element normalisation magnifies it
    # for near-zero gradients; a real mistake (a lost chunk, an unreduced shard) moves weights by ~1e-3.
    for k in (k for k in a if "running" not in k and "num_batches" not in k):
        torch.testing.assert_close(b[k], a[k], atol=3e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch.equal(a["temperature_param"], torch.tensor(1.0))
    state, _ = load_trainer_state(tmp_path / "fsdp" / "checkpoints" / "step_0000002")
    assert len(state["optimizer"]["state"]) == sum(1 for k in a if "running" not in k and "num_batches" not in k)


# ------------------------------------------------------------------------------ damaged checkpoints


def _short_run(run_dir: Path, steps: int, **train_options: Any) -> Any:
    # Dropout on: resuming from a checkpoint must restore its random stream too.
    return tiny_config(
        run_dir,
        train={"steps": steps, "checkpoint_every": 2, "keep_checkpoints": 0, **train_options},
        log={"tensorboard": False, "progress": False},
    )


def _damage(checkpoint: Path, how: str) -> str:
    """Damage a checkpoint as ``how`` says; returns the reason resuming should give for passing over it."""
    if how == "truncated trainer.pt":
        data = (checkpoint / "trainer.pt").read_bytes()
        (checkpoint / "trainer.pt").write_bytes(data[: len(data) // 2])
        return "trainer.pt is truncated or unreadable"
    if how == "NaN weight":
        tensors = load_file(str(checkpoint / "model.safetensors"))
        tensors["text_proj.weight"][0, 0] = float("nan")
        save_file(tensors, str(checkpoint / "model.safetensors"))
        return "1 tensor(s) hold NaN or Inf, e.g. model.text_proj.weight"
    if how == "NaN optimizer state":
        state = torch.load(checkpoint / "trainer.pt", weights_only=True)
        next(iter(state["optimizer"]["state"].values()))["exp_avg_sq"].fill_(float("inf"))
        torch.save(state, checkpoint / "trainer.pt")
        return "1 tensor(s) hold NaN or Inf, e.g. trainer.optimizer.state.0.exp_avg_sq"
    (checkpoint / "model.safetensors").unlink()
    return "missing model.safetensors"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("how", ["truncated trainer.pt", "NaN weight", "NaN optimizer state", "missing file"])
def test_resume_latest_passes_over_a_damaged_newest_checkpoint(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    train(_short_run(tmp_path / "run", 4), stream_factory=factory())
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2, 4]
    shutil.copytree(tmp_path / "run", tmp_path / "direct")
    reason = _damage(tmp_path / "run" / "checkpoints" / "step_0000004", how)
    capsys.readouterr()

    fallback = train(_short_run(tmp_path / "run", 6), resume="latest", stream_factory=factory())
    err = capsys.readouterr().err
    newest, previous = (tmp_path / "run" / "checkpoints" / f"step_000000{s}" for s in (4, 2))
    assert f"resume: skipping {newest}: {reason}" in err
    assert f"resumed from {previous} at step 2" in err and "global batch changes" not in err
    assert len([line for line in err.splitlines() if "skipping" in line]) == 1

    direct = train(
        _short_run(tmp_path / "direct", 6),
        resume=str(tmp_path / "direct" / "checkpoints" / "step_0000002"),
        stream_factory=factory(),
    )
    assert fallback.step == direct.step == 6
    a, b = _weights(fallback.final_dir), _weights(direct.final_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The damaged step was written anew, whole, by the resumed run.
    assert load_trainer_state(newest)[0]["step"] == 4


@pytest.mark.usefixtures("one_thread")
def test_a_run_whose_checkpoints_are_all_damaged_does_not_start_over(tmp_path: Path) -> None:
    train(_short_run(tmp_path / "run", 4), stream_factory=factory())
    for step in (2, 4):
        _damage(tmp_path / "run" / "checkpoints" / f"step_000000{step}", "truncated trainer.pt")
    with pytest.raises(CheckpointError, match=r"none of its 2 checkpoint\(s\) can be resumed from"):
        train(_short_run(tmp_path / "run", 6), resume="latest", stream_factory=factory())
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2, 4]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("how", ["truncated trainer.pt", "NaN weight"])
def test_a_damaged_checkpoint_named_explicitly_is_a_one_line_error(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    train(_short_run(tmp_path / "run", 2), stream_factory=factory())
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002"
    reason = _damage(checkpoint, how)
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint}: {reason}")) as info:
        train(_short_run(tmp_path / "run", 4), resume=str(checkpoint), stream_factory=factory())
    assert "\n" not in str(info.value)
    capsys.readouterr()
    # The command: one line, a non-zero exit, no traceback.
    args = ["train", "--config", "nano_cpu", "--train.run_dir", str(tmp_path / "run"), "--resume", str(checkpoint)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"openalign train: error: {checkpoint}: {reason}") and "\n" not in err


@pytest.mark.usefixtures("one_thread")
def test_changing_the_global_batch_on_resume_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train(_short_run(tmp_path / "run", 2), stream_factory=factory())
    capsys.readouterr()
    make = factory()
    train(_short_run(tmp_path / "run", 4, batch_size=16), resume="latest", stream_factory=make)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "global batch changes from 8 (checkpoint) to 16" in warnings[0]
    assert "each step reads 2× the samples" in warnings[0]
    assert "the 2 steps left read 32 samples instead of 16" in warnings[0]
    assert make.built[0].seen[0] == 16  # the stream goes on at the sample the checkpoint had reached


if __name__ == "__main__":
    main(sys.argv[1:])
