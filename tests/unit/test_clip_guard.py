"""torch's clip_grad_norm_ on an SDP model's parameters warns (`sdp_train.parallel.clip_guard`); on other
parameters, or through the library's own clipping, it does not. (Multi-rank: test_api_training.py.)"""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from masklab import Mask
from sdp_train import SubnetworkDataParallel
from sdp_train.parallel import clip_guard


def _clip(params) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.nn.utils.clip_grad_norm_(params, 1e-3)
    assert all(w.filename == __file__ for w in caught)  # attributed to the caller's line, not torch's
    return [str(w.message) for w in caught]


def _with_grad(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.ones(*shape))
    p.grad = torch.full(shape, 3.0)
    return p


def test_torch_clipping_of_a_watched_parameter_warns_and_still_clips():
    watched, other = _with_grad(4), _with_grad(2)
    clip_guard.watch([watched])
    assert _clip([other]) == []
    assert _clip([other, watched]) == [clip_guard.MESSAGE]
    assert _clip(watched) == [clip_guard.MESSAGE]  # a single tensor, as torch accepts
    assert watched.grad.norm().item() == pytest.approx(1e-3, rel=1e-2)  # torch clipped it all the same


def test_the_guard_is_installed_once_and_forgets_freed_parameters():
    from torch.nn.utils import clip_grad

    clip_guard.install()
    wrapped = clip_grad._clip_grads_with_norm_
    clip_guard.install()
    assert clip_grad._clip_grads_with_norm_ is wrapped and wrapped.sdp_clip_guard
    p = _with_grad(3)
    alive = weakref.ref(p)
    clip_guard.watch([p])
    del p
    gc.collect()
    assert alive() is None  # watched weakly: the guard keeps no parameter (nor its model) alive
    assert _clip([_with_grad(3)]) == []  # and a later one, even at the same address, is not taken for it


def test_one_worker_is_not_watched_since_torch_clipping_is_right_there():
    model = SubnetworkDataParallel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), mask=Mask(np.ones((1, 2))),
                                   blocks=["0", "1"])
    model(torch.ones(1, 2)).sum().backward()
    assert _clip(model.parameters()) == []
