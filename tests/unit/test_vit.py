"""vit-tiny: its parameter count, and its B-SDP / N-SDP subnetworks against the full model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdp_train.errors import ConfigError
from sdp_train.models import block_map, build_model, get_model_config, num_params
from sdp_train.models.subnet import build_worker_model

TINY = get_model_config("vit-tiny", in_channels=1, dim=32, n_heads=2, hidden_dim=64, n_layers=3, patch_size=2,
                        neuron_groups=4)


def test_vit_tiny_has_the_vit_ti_parameter_count():
    model = build_model(get_model_config("vit-tiny"), seed=0)
    assert sum(p.numel() for p in model.parameters()) == num_params(get_model_config("vit-tiny")) == 5_350_090


def test_block_worker_equals_the_full_model_without_the_dropped_blocks():
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    full = build_model(TINY, seed=1)
    del full.layers["1"]
    worker = build_worker_model(TINY, np.array([1, 0, 1]), "block", seed=1)
    torch.testing.assert_close(worker(images), full(images))


def test_neuron_worker_equals_the_full_model_with_the_dropped_neurons_silenced():
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    row = np.zeros(block_map(TINY).num_blocks("neuron"), dtype=bool)
    row[[0, 3, 5, 6, 9]] = True  # layer 0: groups 0, 3; layer 1: 1, 2; layer 2: 1
    full = build_model(TINY, seed=1)
    width = TINY.hidden_dim // TINY.neuron_groups
    with torch.no_grad():  # fc1 row and bias 0 -> gelu(0) = 0: the neuron adds nothing
        for j in np.flatnonzero(~row):
            layer, g = divmod(int(j), TINY.neuron_groups)
            fc1 = full.layers[str(layer)].mlp.fc1
            fc1.weight[g * width:(g + 1) * width] = 0
            fc1.bias[g * width:(g + 1) * width] = 0
    worker = build_worker_model(TINY, row, "neuron", seed=1)
    assert worker.layers["2"].mlp.fc1.weight.shape == (width, TINY.dim)
    torch.testing.assert_close(worker(images), full(images))


def test_image_not_a_multiple_of_the_patch_is_refused():
    with pytest.raises(ConfigError, match=r"image size \(7, 7\) is not a multiple of patch_size=2"):
        build_model(TINY, seed=0)(torch.zeros(1, 1, 7, 7))
