"""Partitioning: which consecutive blocks each pipeline stage gets, and what each block costs."""

from rayspec.partition.choice import PartitionPlan, StageRow, choose_partition, human_bytes, human_count
from rayspec.partition.profile import BlockProfile, profile_blocks
from rayspec.partition.split import (
    PARTITIONS,
    PartitionError,
    block_parameters,
    by_parameters,
    by_profile,
    check_balance,
    min_max_split,
    split,
    uniform,
)

__all__ = ["PARTITIONS", "PartitionError", "uniform", "check_balance", "split", "min_max_split", "block_parameters",
           "by_parameters", "by_profile", "BlockProfile", "profile_blocks", "StageRow", "PartitionPlan",
           "choose_partition", "human_count", "human_bytes"]
