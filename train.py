"""tinyzero entry point: parse the config, initialise distributed, build the trainer, fit, tear down.

    # PPO / GRPO (TinyZero countdown on 2 GPUs)
    python -m tinyzero.data.preprocess.countdown --out data/countdown
    torchrun --nproc_per_node 2 train.py --preset countdown_qwen2_5_3b_ppo \
        --actor_rollout_ref.model.path /models/Qwen2.5-3B --data.train_files data/countdown/train.parquet
    torchrun --nproc_per_node 8 train.py --preset countdown_qwen2_5_3b_grpo --pipeline.placement split

    # SFT, reward model, DPO (the first argument picks the trainer)
    torchrun --nproc_per_node 8 train.py sft --preset sft --data.train_files data/sft/train.parquet
    torchrun --nproc_per_node 8 train.py rm --preset rm
    torchrun --nproc_per_node 8 train.py dpo --preset dpo --dpo.beta 0.1

    # rerun a saved config; resume continues from the run folder's latest checkpoint
    torchrun --nproc_per_node 2 train.py --config runs/x/config.yaml
    torchrun --nproc_per_node 2 --max-restarts 3 train.py --preset demo_cpu     # resume_mode=auto

    # the CPU demo (tiny model, 2 CPU ranks, < 5 minutes)
    python -m tinyzero.demo

`train.py --help` lists every field; `--preset NAME` and `--config FILE` set the defaults under
the flags.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import traceback

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# PyTorch's CPU allocator: blocks of 2 MiB and more page-aligned and backed by transparent huge
# pages. Read once, at torch's first allocation, so it is set before torch is imported; it lowers a
# real model's peak host memory and its page faults (tinyzero.runtime.host_memory). THP_MEM_ALLOC_ENABLE=0
# turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


# trainer.mode -> "module:builder" (imported on use: a PPO run does not import the DPO code, and so on)
BUILDERS = {
    "ppo": "tinyzero.trainer.builder:build_ppo_trainer",
    "sft": "tinyzero.trainer.sft:build_sft_trainer",
    "rm": "tinyzero.trainer.rm:build_rm_trainer",
    "dpo": "tinyzero.trainer.dpo:build_dpo_trainer",
}


def run(cfg) -> dict:
    """Build and fit the trainer the config's mode names; returns the final metrics (every rank)."""
    import importlib

    module, name = BUILDERS[cfg.trainer.mode].split(":")
    trainer = getattr(importlib.import_module(module), name)(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


REPORT_GRACE_S = 3.0


def _after_report(code: int, reported: bool | None = None) -> int:
    """The exit code of an error one rank reports (rank 0 unless `reported` says whether this rank
    did). The others wait a moment first: torchrun stops the whole job when the first rank exits, and
    the reporting rank must not be stopped before it prints."""
    from tinyzero.distributed import get_rank
    from tinyzero.trainer.preemption import uninstall_stop_handlers

    if not (get_rank() == 0 if reported is None else reported):
        uninstall_stop_handlers()  # torchrun's SIGTERM then ends this rank quietly: the error is reported
        time.sleep(REPORT_GRACE_S)
    return code


def _debug_traceback() -> None:
    """With TINYZERO_DEBUG=1, the traceback behind a one-line error."""
    if os.environ.get("TINYZERO_DEBUG") == "1":
        traceback.print_exc()


def _report_one_line(e: BaseException) -> int | None:
    """A user error (failure.is_user_error), raised on this rank or on another one (a RemoteWorkerError
    that carries it): one line naming the failing rank, printed by one rank. A collective that timed
    out: one line naming the rank that did not arrive. None for a bug (its traceback is printed)."""
    from tinyzero.distributed import get_rank, get_world_size
    from tinyzero.runtime.progress import HANG_EXIT_CODE
    from tinyzero.single_controller.failure import (
        RemoteWorkerError,
        describe_failure,
        is_collective_timeout,
        is_user_error,
        one_line,
        record_abort,
        timeout_report,
    )

    rank = get_rank()
    if is_collective_timeout(e):
        print(timeout_report(e, rank, get_world_size()), file=sys.stderr, flush=True)
        _debug_traceback()
        return HANG_EXIT_CODE
    if isinstance(e, RemoteWorkerError):
        if e.user_error is None:
            return None
        failed, message = e.user_error
        reported = failed == rank
    elif is_user_error(e):
        # The same bad input often stops several ranks: the first to record it reports it, and the
        # record tells ranks still waiting for this one why it stopped.
        failed, message = rank, one_line(e)
        reported = record_abort(describe_failure(e, f"rank {rank}", rank))
    else:
        return None
    if reported:
        print(f"[rank {failed}] error: {message}", file=sys.stderr, flush=True)
        _debug_traceback()
    return _after_report(2, reported)


def main(argv: list[str] | None = None) -> int:
    from tinyzero.cli import parse_args
    from tinyzero.config import ConfigError
    from tinyzero.distributed import (
        cleanup,
        device_type,
        get_rank,
        init_distributed,
        resolve_collective_timeout_s,
        set_seed,
    )
    from tinyzero.distributed.shm_comm import enable_shm_collectives
    from tinyzero.rewards.manager import RewardError
    from tinyzero.runtime.host_memory import keep_freed_memory, set_mmap_threshold, set_trim_threshold
    from tinyzero.runtime.progress import start_watchdog, stop_watchdog
    from tinyzero.single_controller.failure import report_as_user_errors
    from tinyzero.trainer.checkpoint import CheckpointSpaceError
    from tinyzero.trainer.loop import NonFiniteError
    from tinyzero.trainer.preemption import (
        Preempted,
        exit_if_signalled,
        install_stop_handlers,
        uninstall_stop_handlers,
    )
    from tinyzero.trainer.runlock import RunFolderBusy, hold_run_folder

    # Config checks are the same on every rank, so only rank 0 reports them (once per job).
    quiet = get_rank() != 0
    try:
        with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
            cfg = parse_args(argv)  # tyro reports bad flags itself and exits (SystemExit)
            resolve_collective_timeout_s(cfg.reliability.collective_timeout_s)  # TINYZERO_COLLECTIVE_TIMEOUT_S
    except (ValueError, SystemExit) as e:
        if isinstance(e, SystemExit) and e.code in (0, None):  # --help
            raise
        if not quiet and isinstance(e, ValueError):
            print(f"config error: {e}", file=sys.stderr, flush=True)
            _debug_traceback()
        return _after_report(2)
    if cfg.trainer.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if cfg.tuning.host_mmap_threshold_kb > 0:
        set_mmap_threshold(cfg.tuning.host_mmap_threshold_kb * 1024)
    set_trim_threshold(cfg.tuning.host_trim_threshold_mb * 2**20)
    on_cpu = cfg.trainer.device == "cpu" or device_type() == "cpu"
    if cfg.tuning.keep_freed_memory(on_cpu=on_cpu):
        keep_freed_memory()
    enable_shm_collectives(cfg.tuning.use_shm_collectives(on_cpu=on_cpu))
    # Raised in a worker, these reach the other ranks as one line too (single_controller.failure).
    report_as_user_errors(RunFolderBusy, CheckpointSpaceError, Preempted, NonFiniteError)
    try:
        init_distributed(cfg.reliability.collective_timeout_s)
        start_watchdog(cfg.reliability.hang_timeout_s)
        set_seed(cfg.trainer.seed)
        with hold_run_folder(cfg.trainer.default_local_dir):  # before anything in the folder is written
            if cfg.reliability.save_on_signal:  # every trainer's loop (trainer/loop.py) checks at each step's end
                install_stop_handlers(cfg.reliability.signal_grace_s)
            run(cfg)
        return 0
    except ConfigError as e:
        if get_rank() == 0:
            print(f"config error: {e}", file=sys.stderr, flush=True)
            _debug_traceback()
        return _after_report(2)
    except (RunFolderBusy, CheckpointSpaceError, Preempted, RewardError) as e:
        # Decided on rank 0 and shared (or agreed by a collective), so every rank raises it: rank 0 reports.
        if get_rank() == 0:
            print(f"stopped: {e}", file=sys.stderr, flush=True)
            _debug_traceback()
        return _after_report(getattr(e, "exit_code", 2))
    except NonFiniteError as e:
        # Not a bug to debug: the message says which step, what was non-finite and what to change.
        # Metrics are reduced over ranks, so every rank stops at the same step: rank 0 reports it.
        if get_rank() == 0:
            print(f"stopped: {e}", file=sys.stderr, flush=True)
        return _after_report(3)
    except BaseException as e:
        # An input the user can fix (a bad data row, a missing file, a bad tool or model file), raised
        # here or in a worker on any rank, or a timed-out collective: one line. Anything else is a bug:
        # its traceback.
        code = _report_one_line(e)
        if code is not None:
            return code
        print(f"[rank {get_rank()}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        exit_if_signalled()  # torchrun sends SIGTERM to the survivors of a failed rank: skip the teardown
        raise
    finally:
        uninstall_stop_handlers()
        stop_watchdog()
        cleanup()


if __name__ == "__main__":
    sys.exit(main())
