"""Data: the RL parquet contract, RL / SFT / pairwise datasets, and the resumable dataloader.

    from tinyzero.data import DataConfig, RLHFDataset, StatefulDataLoader, validate_rl_parquet
    n = validate_rl_parquet("train.parquet")                    # ValueError names file, row, field
    ds = RLHFDataset(["train.parquet"], tokenizer, DataConfig(max_prompt_length=256))
    loader = StatefulDataLoader(ds, batch_size=64, shuffle=True, seed=1)   # yields DataProto

`build_rl_dataloaders(config, tokenizer)` builds the train and validation loaders the PPO
trainer uses. Task generators live in `tinyzero.data.preprocess`.
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
    "build_rl_dataloaders",
    "collate_to_dataproto",
    "compute_position_ids",
    "left_pad",
    "load_rl_parquet",
    "render_prompt",
    "validate_rl_parquet",
    "validate_rl_row",
    "write_parquet",
]


def build_rl_dataloaders(config: DataConfig, tokenizer):
    """(train_loader, val_loader or None) for PPO: a shuffled, resumable training loader and an
    in-order validation loader (the whole set in one batch unless data.val_batch_size is set)."""
    if not config.train_files:
        raise ValueError("data.train_files is empty; give one or more RL parquet files")
    train_ds = RLHFDataset(config.train_files, tokenizer, config)
    train = StatefulDataLoader(train_ds, config.train_batch_size, shuffle=config.shuffle, seed=config.seed,
                               drop_last=config.drop_last)
    val = None
    if config.val_files:
        val_ds = RLHFDataset(config.val_files, tokenizer, config)
        val = StatefulDataLoader(val_ds, config.val_batch_size or len(val_ds), shuffle=False,
                                 drop_last=False)
    return train, val
