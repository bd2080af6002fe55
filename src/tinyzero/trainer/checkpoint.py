"""Atomic, sharded training checkpoints (torch.distributed.checkpoint) and resume.

Layout of one checkpoint (several roles write into one step folder, the trainer finalizes it):

    <root>/global_step_<N>/
        actor/             DCP shards of model + optimizer (.distcp, .metadata), lr_scheduler.pt
        critic/            the same for the critic, written by its own worker group
        rng/rank_<r>.json  python / numpy / torch / cuda RNG states of every global rank
        trainer_state.json global step, dataloader state, anything JSON-serializable
        COMPLETE.json      written last: manifest of every file with its size and sha256
    <root>/latest_checkpointed_iteration.txt  (veRL's name; informative, `latest()` scans folders)

Protocol (every rank calls these in the same order, SPMD):

    mgr = CheckpointManager(root, keep_last=3)
    tmp = mgr.begin_save(step)                       # <root>/global_step_N.tmp-XXXX, same on all ranks
    save_state(os.path.join(tmp, "actor"), model, optim, sched, process_group=actor_group)  # models.role_state
    save_rng_state(tmp); save_trainer_state(tmp, {...})
    mgr.finalize(step, tmp)                          # fsync, COMPLETE.json, rename, prune

A crash (even kill -9) before the rename leaves a `.tmp-` folder that is never loaded; the
previous checkpoint stays the latest. `latest()` skips folders whose marker is missing or whose
files do not match the manifest, with a warning naming them.
Resuming with another number of ranks works: DCP reshards model and optimizer; RNG states of
ranks that did not exist are derived from (step, rank) with a warning.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import warnings

import numpy as np
import torch
import torch.distributed as dist

from tinyzero.models.role_state import load_state, save_state  # noqa: F401 - the role folders it publishes
from tinyzero.runtime.fileio import atomic_write_text as _atomic_write_text
from tinyzero.runtime.fileio import fsync_path as _fsync_path

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer_state.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_TMP_RE = re.compile(r"^global_step_(\d+)\.tmp-")
_OLD_RE = re.compile(r"^global_step_(\d+)\.old-")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sha256(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# Room a save needs beyond the last checkpoint's size (new files may be a little larger).
SPACE_MARGIN_FRACTION = 0.05
SPACE_MARGIN_BYTES = 16 << 20
# A failed save with less free space than this is taken as a full disk (torch.save may not say ENOSPC).
NEARLY_FULL_BYTES = 1 << 20


class CheckpointSpaceError(RuntimeError):
    """Not enough disk space to save; the previous checkpoint is untouched. Every rank raises it."""


def _is_no_space(exc: BaseException | None) -> bool:
    """Whether an exception (or its cause, context, or a DCP per-rank failure) is ENOSPC."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        failures = getattr(exc, "failures", None)  # torch's CheckpointException: {rank: exception}
        if isinstance(failures, dict) and any(_is_no_space(f) for f in failures.values()
                                              if isinstance(f, BaseException)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _tree_bytes(path: str) -> int:
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(d, n))
    return total


def _any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is True on any (world group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def step_of(path: str) -> int:
    """The global step of a `global_step_N` folder."""
    m = _STEP_RE.match(os.path.basename(os.path.normpath(path)))
    if not m:
        raise ValueError(f"{path!r} is not a global_step_<N> checkpoint folder")
    return int(m.group(1))


def verify_checkpoint(path: str, checksum: bool = True) -> str | None:
    """None if `path` is a complete checkpoint, else the reason it is not."""
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        return "not a folder"
    if not os.path.isfile(marker):
        return f"no {MARKER} (half-written?)"
    try:
        with open(marker) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable {MARKER}: {e}"
    for rel, info in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"missing file {rel}"
        if os.path.getsize(full) != info["size"]:
            return f"size of {rel} is {os.path.getsize(full)}, manifest says {info['size']}"
        if checksum and info.get("sha256") and _sha256(full) != info["sha256"]:
            return f"checksum mismatch in {rel}"
    return None


class CheckpointManager:
    """Owns `<root>`: atomic step folders, finding the latest valid one, keeping the last K."""

    def __init__(self, root: str, keep_last: int | None = None, checksum: bool = True):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: use a positive number, or None to keep every checkpoint")
        self.root = os.path.abspath(root)
        self.keep_last = keep_last
        self.checksum = checksum

    # ------------------------------------------------------------------ save
    def begin_save(self, step: int) -> str:
        """Create the temporary folder of step `step` and return its path (identical on every rank)."""
        name = [None, None]  # [temporary folder, error]
        if _rank() == 0:
            os.makedirs(self.root, exist_ok=True)
            self._remove_stale_tmp()
            name[1] = self._space_error(step)
            if name[1] is None:
                name[0] = tempfile.mkdtemp(prefix=f"global_step_{step}.tmp-", dir=self.root)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(name, src=0)
        if name[1] is not None:
            raise CheckpointSpaceError(name[1])
        return name[0]

    def _space_error(self, step: int, written: int = 0) -> str | None:
        """One line if the disk under root cannot hold another checkpoint the size of the last one."""
        previous = self.checkpoints()
        last_bytes = 0
        if previous:
            with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):
                with open(os.path.join(previous[0][1], MARKER)) as f:
                    last_bytes = sum(int(v["size"]) for v in json.load(f)["files"].values())
        needed = int(max(last_bytes, written) * (1 + SPACE_MARGIN_FRACTION)) + SPACE_MARGIN_BYTES
        free = shutil.disk_usage(self.root).free
        if free >= needed and not written:
            return None
        intact = f"the previous checkpoint {previous[0][1]} is intact" if previous else "no earlier checkpoint exists"
        return (f"not enough disk space to save step {step} in {self.root}: {needed} bytes needed, {free} free; "
                f"{intact}. Free space or set trainer.default_local_dir on a larger disk")

    @contextlib.contextmanager
    def saving(self, step: int):
        """begin_save / finalize around the body, which writes into the yielded folder (every rank).

        Every rank agrees on the outcome first: if the body failed anywhere, the temporary folder is
        dropped on all ranks and the error is raised on all of them (CheckpointSpaceError in one line
        when the disk is full), so the previous checkpoint stays the latest and no rank waits forever.
        """
        tmp = self.begin_save(step)
        error = None
        try:
            yield tmp
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException; re-raised below
            error = e
        if not _any_rank(error is not None):
            self.finalize(step, tmp)
            return
        # Some writers (torch.save) do not say ENOSPC: a nearly full disk counts as the reason too.
        any_enospc = _any_rank(_is_no_space(error))
        space = [None]
        if _rank() == 0 and (any_enospc or shutil.disk_usage(self.root).free < NEARLY_FULL_BYTES):
            space[0] = self._space_error(step, written=_tree_bytes(tmp))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(space, src=0)
        self.abort(tmp)
        if space[0] is not None:
            raise CheckpointSpaceError(space[0]) from error
        if error is not None:
            raise error
        raise RuntimeError(f"saving step {step} failed on another rank (its error is above); the previous "
                           "checkpoint is intact")

    def finalize(self, step: int, tmp_dir: str, extra: dict | None = None) -> str:
        """Seal `tmp_dir` (after every rank wrote its part) as `<root>/global_step_<step>`; return that path.

        Every rank fsyncs and hashes a share of the files (round robin), rank 0 writes the manifest
        (COMPLETE.json, last) and renames the folder.
        """
        _barrier()
        final = os.path.join(self.root, f"global_step_{step}")
        listing: list = [None, None]  # [relative file paths, error]
        if _rank() == 0:
            if not os.path.isdir(tmp_dir) or not _TMP_RE.match(os.path.basename(tmp_dir)):
                listing[1] = f"{tmp_dir!r} is not a folder returned by begin_save"
            else:
                listing[0] = sorted(os.path.relpath(os.path.join(d, n), tmp_dir)
                                    for d, _, names in os.walk(tmp_dir) for n in names)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            dist.broadcast_object_list(listing, src=0)
        if listing[1] is not None:
            raise ValueError(listing[1])
        world = dist.get_world_size() if distributed else 1
        mine = {}
        for rel in listing[0][_rank()::world]:
            full = os.path.join(tmp_dir, rel)
            _fsync_path(full)
            mine[rel] = {"size": os.path.getsize(full)}
            if self.checksum:
                mine[rel]["sha256"] = _sha256(full)
        parts = [None] * world if _rank() == 0 else None
        if distributed:
            dist.gather_object(mine, parts, dst=0)
        else:
            parts = [mine]
        if _rank() == 0:
            files = {k: v for part in parts for k, v in part.items()}
            for d, _, _ in os.walk(tmp_dir):
                _fsync_path(d, directory=True)
            manifest = {"format": 1, "global_step": step, "files": dict(sorted(files.items())), **(extra or {})}
            _atomic_write_text(os.path.join(tmp_dir, MARKER), json.dumps(manifest, indent=1))
            old = None
            if os.path.exists(final):  # re-saving a step: move the old one aside, swap, then delete it
                old = tempfile.mkdtemp(prefix=f"global_step_{step}.old-", dir=self.root)
                os.rmdir(old)
                os.replace(final, old)
            os.replace(tmp_dir, final)
            _fsync_path(self.root, directory=True)
            if old:
                shutil.rmtree(old, ignore_errors=True)
            _atomic_write_text(os.path.join(self.root, LATEST_FILE), str(step))
            self._prune()
        _barrier()
        return final

    def abort(self, tmp_dir: str) -> None:
        """Drop a temporary folder (e.g. after a failed save)."""
        if _rank() == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        _barrier()

    # ------------------------------------------------------------------ find
    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of every `global_step_N` folder under root, newest first (not validated)."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for name in os.listdir(self.root):
            m = _STEP_RE.match(name)
            if m and os.path.isdir(os.path.join(self.root, name)):
                out.append((int(m.group(1)), os.path.join(self.root, name)))
        return sorted(out, reverse=True)

    def latest(self) -> str | None:
        """Newest complete checkpoint; incomplete or corrupted ones are skipped with a warning naming them."""
        for _, path in self.checkpoints():
            reason = verify_checkpoint(path, checksum=self.checksum)
            if reason is None:
                return path
            warnings.warn(f"skipping invalid checkpoint {path}: {reason}", stacklevel=2)
        return None

    def resolve_resume(self, resume: str) -> str | None:
        """`resume` = "auto" (latest valid, or None), "disable" (None), or a checkpoint folder (validated).

        Collective when torch.distributed is initialized: rank 0 validates (reading every file once, not once
        per rank) and broadcasts the answer, so every rank resumes from the same folder or raises the same error.
        """
        result: list = [None, None]  # [path, error message]
        if _rank() == 0:
            try:
                result[0] = self._resolve_resume_local(resume)
            except ValueError as e:
                result[1] = str(e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(result, src=0)
        if result[1] is not None:
            raise ValueError(result[1])
        return result[0]

    def _resolve_resume_local(self, resume: str) -> str | None:
        if resume in ("disable", "", None):
            return None
        if resume == "auto":
            return self.latest()
        path = os.path.abspath(resume)
        reason = verify_checkpoint(path, checksum=self.checksum)
        if reason is not None:
            raise ValueError(f"cannot resume from {resume!r}: {reason}. Use resume=auto to take the latest "
                             "valid checkpoint, or resume=disable to start fresh")
        step_of(path)
        return path

    # ------------------------------------------------------------------ housekeeping
    def _remove_stale_tmp(self) -> None:
        """Drop folders of interrupted saves. A step that was being re-saved (moved aside to `.old-`) whose
        replacement never landed is moved back, so a crash in that window loses nothing."""
        for name in sorted(os.listdir(self.root)):
            full = os.path.join(self.root, name)
            old = _OLD_RE.match(name)
            if name.startswith(LATEST_FILE + ".tmp-"):
                os.remove(full)
            elif old and not os.path.exists(os.path.join(self.root, f"global_step_{old.group(1)}")) \
                    and verify_checkpoint(full, checksum=False) is None:
                warnings.warn(f"restoring {full} as global_step_{old.group(1)} (its re-save was interrupted)",
                              stacklevel=3)
                os.replace(full, os.path.join(self.root, f"global_step_{old.group(1)}"))
            elif _TMP_RE.match(name) or old:
                warnings.warn(f"removing unfinished checkpoint {full}", stacklevel=3)
                shutil.rmtree(full, ignore_errors=True)

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        valid = [(s, p) for s, p in self.checkpoints() if os.path.isfile(os.path.join(p, MARKER))]
        for _, path in valid[self.keep_last:]:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- RNG + trainer state


def _tensor_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _b64_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def get_rng_state() -> dict:
    """This process's python / numpy / torch / cuda RNG states as a JSON-able dict."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": _tensor_b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_tensor_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `get_rng_state` returned."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_b64_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_b64_tensor(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            torch.cuda.set_rng_state(saved[0])


def save_rng_state(step_dir: str) -> None:
    """Every rank writes `rng/rank_<r>.json`."""
    os.makedirs(os.path.join(step_dir, "rng"), exist_ok=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    payload = {"world_size": world, **get_rng_state()}
    _atomic_write_text(os.path.join(step_dir, "rng", f"rank_{_rank()}.json"), json.dumps(payload))


def load_rng_state(step_dir: str, seed: int = 0) -> bool:
    """Restore this rank's RNG state; True if found. A rank the checkpoint did not have is seeded from
    (seed, step, rank) with a warning (resuming on more ranks than were saved)."""
    rank = _rank()
    path = os.path.join(step_dir, "rng", f"rank_{rank}.json")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if os.path.isfile(path):
        with open(path) as f:
            state = json.load(f)
        saved_world = int(state.get("world_size", world))
        if saved_world != world and rank == 0:
            warnings.warn(f"{step_dir} was saved by {saved_world} ranks and is resumed on {world}: ranks "
                          f"present in both get their RNG streams back, "
                          f"{'new ranks get derived seeds' if world > saved_world else 'the others are dropped'}",
                          stacklevel=2)
        set_rng_state(state)
        return True
    step = step_of(step_dir)
    derived = (seed * 1_000_003 + step * 7919 + rank) % (2**31)
    warnings.warn(f"{step_dir} has no RNG state for rank {rank} (saved with fewer ranks); seeding it with "
                  f"{derived} derived from (seed, step, rank)", stacklevel=2)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    return False


def save_trainer_state(step_dir: str, state: dict) -> None:
    """Rank 0 writes `trainer_state.json` (global step, dataloader state, ...). `state` must be JSON-able."""
    if _rank() != 0:
        return
    try:
        text = json.dumps(state, indent=1)
    except TypeError as e:
        raise ValueError(f"trainer state must be JSON-serializable: {e}") from e
    _atomic_write_text(os.path.join(step_dir, TRAINER_STATE), text)


def load_trainer_state(step_dir: str) -> dict:
    """The dict `save_trainer_state` wrote."""
    path = os.path.join(step_dir, TRAINER_STATE)
    if not os.path.isfile(path):
        raise ValueError(f"{step_dir!r} has no {TRAINER_STATE}")
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except ValueError as e:  # not JSON, or not UTF-8 text
        raise ValueError(f"{path}: not a readable trainer state ({e}); resume from another checkpoint "
                         "(trainer.resume_from_path) or start fresh (trainer.resume_mode=disable)") from e
    if not isinstance(state, dict) or "global_step" not in state:
        raise ValueError(f"{path}: not a trainer state (a JSON object with global_step); resume from another "
                         "checkpoint (trainer.resume_from_path) or start fresh (trainer.resume_mode=disable)")
    return state
