"""Data for SDP training without downloads: stdlib bytes, digits, and loaders for user files.

Every stream is per rank, deterministic in (seed, rank, world_size, step) and resumable through
``state_dict()`` / ``load_state_dict()``. `build_batches` is the entry point; the loaders are
public for users who assemble their own streams.
"""

from sdp_train.data.batches import Batches, shard_items
from sdp_train.data.config import DATASETS, IMAGE_DATASETS, DataConfig, build_batches
from sdp_train.data.images import ImageBatches, digits_split, load_cifar_batches
from sdp_train.data.text import TokenBatches, load_token_shard, stdlib_corpus, stdlib_files

__all__ = [
    "DATASETS", "IMAGE_DATASETS", "Batches", "DataConfig", "ImageBatches", "TokenBatches", "build_batches", "digits_split",
    "load_cifar_batches", "load_token_shard", "shard_items", "stdlib_corpus", "stdlib_files",
]
