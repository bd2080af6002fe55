"""Start-up check that every rank of a multi-node job sees one checkpoint folder.

A checkpoint is written by every rank: each writes its DCP shards and RNG state into
`<trainer.default_local_dir>/checkpoints/global_step_N.tmp-*`, a folder rank 0 creates; rank 0
then lists that folder, every rank hashes a share of the files, and rank 0 seals it. A resume
reads shards written by other ranks (DCP keeps one copy of a replicated tensor, and reshards on
another world size). So the folder must be one filesystem shared by all nodes, mounted at the
same path everywhere: with node-local disks each node would hold only its own shards and the
first save would fail after the run had already trained. This module finds that out in seconds:

    check_shared_folder(path, "trainer.default_local_dir")   # every rank (collective)

Rank 0 creates a fresh probe folder `<path>/.storage_probe-XXXX`, every rank writes a file named
by its rank into it (a rank on another disk does not even find the folder), and rank 0 lists it
once everyone is done. Anything missing raises ConfigError on every rank naming the setting and
the ranks and hosts that cannot see rank 0's files. The probe folder is removed afterwards; nothing
else in `path` (earlier checkpoints) is read or touched.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

import torch.distributed as dist

from tinyzero.config import ConfigError
from tinyzero.distributed import get_rank, get_world_size, is_distributed

PROBE_PREFIX = ".storage_probe-"
# Some shared filesystems show a file written on another node a moment late: list again before failing.
LIST_ATTEMPTS = 5
LIST_INTERVAL_S = 1.0


def _write_probe(path: str, name: str, rank: int, host0: str) -> str | None:
    """Write `<path>/<name>/rank_<rank>` (the probe folder must already exist); None, or what went wrong."""
    probe_dir = os.path.join(path, name)
    for attempt in range(LIST_ATTEMPTS):
        if os.path.isdir(probe_dir):
            break
        if attempt + 1 < LIST_ATTEMPTS:
            time.sleep(LIST_INTERVAL_S)
    else:
        return f"rank {rank} (host {socket.gethostname()}) does not see {probe_dir}, which rank 0 (host {host0}) created"
    try:
        with open(os.path.join(probe_dir, f"rank_{rank}"), "w") as f:
            f.write(socket.gethostname())
    except OSError as e:
        return f"rank {rank} (host {socket.gethostname()}) cannot write into {probe_dir}: {e}"
    return None


def _missing_ranks(probe_dir: str, world: int) -> list[int]:
    """Ranks whose probe file rank 0 does not see, after a few bounded re-listings."""
    missing: list[int] = []
    for attempt in range(LIST_ATTEMPTS):
        seen = set(os.listdir(probe_dir))
        missing = [r for r in range(world) if f"rank_{r}" not in seen]
        if not missing:
            break
        if attempt + 1 < LIST_ATTEMPTS:
            time.sleep(LIST_INTERVAL_S)
    return missing


def _first(items: list[str], limit: int, sep: str) -> str:
    """The first `limit` items joined, and how many more there are."""
    return sep.join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_shared_folder(path: str, setting: str) -> None:
    """Raise ConfigError on every rank unless all ranks see the same folder `path` (collective, world group).

    `setting` names the option that chose `path` (the message tells the user to change it).
    """
    if not (is_distributed() and get_world_size() > 1):
        return
    rank, world = get_rank(), get_world_size()
    created: list = [None, None, socket.gethostname()]  # [probe folder name, error, rank 0's host]
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            created[0] = os.path.basename(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=path))
        except OSError as e:
            created[1] = f"rank 0 cannot create a folder in {path} (set by {setting}): {e}"
    dist.broadcast_object_list(created, src=0)
    if created[1] is not None:
        raise ConfigError(created[1])
    name = created[0]
    problem = _write_probe(path, name, rank, created[2])
    problems = [None] * world if rank == 0 else None
    dist.gather_object(problem, problems, dst=0)  # every rank has written (or failed) past this point
    verdict = [None]
    if rank == 0:
        probe_dir = os.path.join(path, name)
        failed = [p for p in problems if p is not None]
        missing = [] if failed else _missing_ranks(probe_dir, world)
        shutil.rmtree(probe_dir, ignore_errors=True)
        if failed or missing:
            detail = _first(failed, 4, "; ") if failed else \
                f"rank 0 does not see the files ranks {_first([str(r) for r in missing], 16, ', ')} wrote into {probe_dir}"
            verdict[0] = (f"{path} (set by {setting}) must be on a filesystem shared by all nodes and mounted at "
                          f"the same path on each (NFS, Lustre, GPFS, ...): every rank writes its checkpoint shards "
                          f"there and a resume reads shards other ranks wrote. {detail}. Set {setting} to a folder "
                          f"on such a filesystem, or run on one node")
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
