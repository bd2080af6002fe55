"""Data: the RL parquet contract, RL / SFT / pairwise datasets, and the resumable dataloader.

    from tinyzero.data import DataConfig, RLHFDataset, StatefulDataLoader, validate_rl_parquet
    n = validate_rl_parquet("train.parquet")                    # ValueError names file, row, field
    ds = RLHFDataset(["train.parquet"], tokenizer, DataConfig(max_prompt_length=256))
    loader = StatefulDataLoader(ds, batch_size=64, shuffle=True, seed=1)   # yields DataProto

Every trainer builds its datasets and loader in `tinyzero.trainer.setup.prepare_run`. Task
generators live in `tinyzero.data.preprocess`.
"""

from tinyzero.data.config import TRUNCATION_MODES, DataConfig
from tinyzero.data.loader import StatefulDataLoader, StatefulSampler, collate_to_dataproto
from tinyzero.data.rl_dataset import RLHFDataset, compute_position_ids, left_pad, render_prompt
from tinyzero.data.schema import (
    REQUIRED_FIELDS,
    load_rl_parquet,
    validate_rl_parquet,
    validate_rl_row,
    write_parquet,
)
from tinyzero.data.sft_dataset import PairwiseDataset, SFTDataset

__all__ = [
    "DataConfig",
    "PairwiseDataset",
    "REQUIRED_FIELDS",
    "RLHFDataset",
    "SFTDataset",
    "StatefulDataLoader",
    "StatefulSampler",
    "TRUNCATION_MODES",
    "collate_to_dataproto",
    "compute_position_ids",
    "left_pad",
    "load_rl_parquet",
    "render_prompt",
    "validate_rl_parquet",
    "validate_rl_row",
    "write_parquet",
]

