"""Older torch that pyproject allows: the package imports without FSDP2's private custom-collective API.

A fresh interpreter removes AllGather / ReduceScatter from torch.distributed.fsdp._fully_shard._fsdp_api
(as torch releases without them), imports every module that used it at load time, and checks that shared-memory collectives are
then declined (FSDP2 keeps its own) with one warning instead of an ImportError.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys, warnings
import torch
import torch.distributed.fsdp._fully_shard._fsdp_api as api
del api.AllGather, api.ReduceScatter  # as in torch releases without FSDP2's custom-collective hooks

import tinyzero.distributed.shm_comm as shm
import tinyzero.models.fsdp  # noqa: F401
import tinyzero.distributed.full_params  # noqa: F401
assert shm.FSDP_HOOKS is False

class Unit:
    def set_custom_all_gather(self, hook):
        raise AssertionError("hooks must not be installed")

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert shm.use_shm_collectives([Unit()], None, torch.device("cpu"), 10.0) is None
    assert shm.use_shm_collectives([Unit()], None, torch.device("cpu"), 10.0) is None
assert len([w for w in caught if "shm_collectives is ignored" in str(w.message)]) == 1, caught
print("ok")
"""


@pytest.mark.slow
def test_imports_without_private_fsdp_api():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
