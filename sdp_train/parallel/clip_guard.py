"""A warning when ``torch.nn.utils.clip_grad_norm_`` clips the gradients of an SDP model.

Under SDP every rank holds other blocks, so torch's clipping computes a different norm on every
rank and holders of one block scale its (identical) averaged gradient by different factors: their
copies drift apart silently. `SubnetworkDataParallel.clip_grad_norm_` counts every block once
across ranks and applies one factor everywhere. `watch` marks a multi-rank SDP model's
parameters; a torch clipping call that touches one of them warns (a `UserWarning` attributed to
the caller's line, so Python's default filter shows it once per line).

How it is detected: torch's ``clip_grad_norm_`` calls the module global
``torch.nn.utils.clip_grad._clip_grads_with_norm_`` at call time, which `install` wraps once with
a membership test of the clipped parameters in a weak table (one Python pass over the list that
torch's own function already makes). Nothing else of torch is touched; a torch without that
global gets no warning. Calls of ``torch.nn.utils.clip_grads_with_norm_`` itself are not seen.
Not here: overlap averaging, whose workers keep their own gradients (torch's clipping is right there).
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Iterable

import torch

MESSAGE = ("torch.nn.utils.clip_grad_norm_ on the parameters of a SubnetworkDataParallel model computes a "
           "different norm on every rank (each holds other blocks), so the holders of a block scale its "
           "averaged gradient by different factors and their copies drift apart: call "
           "model.clip_grad_norm_(max_norm), which counts every block once across ranks")
# by id, holding the parameters weakly: an entry goes with its parameter, so a reused id is never
# mistaken for it (a WeakSet would compare tensors with ==, which is elementwise)
_watched: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def watch(parameters: Iterable[torch.Tensor]) -> None:
    """Warn when torch's ``clip_grad_norm_`` clips any of `parameters` (installs the check once)."""
    _watched.update((id(p), p) for p in parameters)
    install()


def install() -> None:
    """Wrap torch's ``_clip_grads_with_norm_`` with the check (once; a no-op where torch lacks it)."""
    from torch.nn.utils import clip_grad

    original = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if original is None or getattr(original, "sdp_clip_guard", False):
        return

    def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
        if _watched:
            _check(parameters)
        return original(parameters, max_norm, total_norm, foreach)

    clip_grads_with_norm_.sdp_clip_guard = True
    clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_


def _check(parameters) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    if any(_watched.get(id(p)) is p for p in params):
        warnings.warn(MESSAGE, UserWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The `warnings.warn` stack level of the first frame outside this module and torch (the caller
    of ``clip_grad_norm_``, past torch's decorators, however many there are)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frame, level = sys._getframe(1), 1  # level 1: the frame that calls warnings.warn (`_check`)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or frame.f_code.co_filename.startswith(torch_dir)):
        frame, level = frame.f_back, level + 1
    return level
