"""CIFAR-format python batches the tests generate: learnable, so that accuracy can rise above chance.

Each class c has its own mean image (a fixed random pattern per class); an example is that mean
plus noise, quantised to uint8. A model that learns the patterns classifies most examples.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar_dir(root: Path, *, classes: int = 10, train: int = 512, test: int = 256, noise: float = 40.0,
                    seed: int = 0) -> Path:
    """Write CIFAR-10's layout (``data_batch_1``, ``data_batch_2``, ``test_batch``) or, with
    `classes` 100, CIFAR-100's (``train``, ``test``, ``fine_labels``) into `root`; returns `root`."""
    rng = np.random.default_rng(seed)
    means = rng.uniform(48, 208, size=(classes, 3072))
    key = b"labels" if classes == 10 else b"fine_labels"

    def batch(n: int) -> dict[bytes, object]:
        labels = rng.integers(0, classes, n)
        data = np.clip(means[labels] + rng.normal(0, noise, (n, 3072)), 0, 255).astype(np.uint8)
        return {b"data": data, key: [int(v) for v in labels]}

    root.mkdir(parents=True, exist_ok=True)
    names = (["data_batch_1", "data_batch_2"], "test_batch") if classes == 10 else (["train"], "test")
    for i, name in enumerate(names[0]):
        with open(root / name, "wb") as f:
            pickle.dump(batch(train // len(names[0])), f)
    with open(root / names[1], "wb") as f:
        pickle.dump(batch(test), f)
    return root
