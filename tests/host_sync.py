"""A detector of host synchronisations, shared by the kernel, library and trainer tests.

Inside `HostSyncDetector` every call that reads a tensor's value on the host (``item``, ``tolist``,
``cpu``, a Python ``bool``/``float``/``int`` of a tensor) fails, and with ``uploads=True`` so does
every tensor built from host data (``torch.tensor``, ``torch.as_tensor``: a host-to-device copy on a
GPU). On CPU nothing really waits, but the same calls on a GPU stall the host behind the device.
torch's optimizers are exempt: without ``capturable`` they keep their step counts in host tensors,
whose reads wait for nothing.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
}
"""What reads a device value on the host."""
UPLOADS = {torch.tensor, torch.as_tensor}
"""What builds a tensor from host data."""


_OPTIM = os.path.join(os.path.dirname(torch.__file__), "optim") + os.sep


def _names_a_device(args, kwargs) -> bool:
    return any(isinstance(a, (torch.device, str)) for a in (*args, *kwargs.values()))


class HostSyncDetector(TorchFunctionMode):
    """Fails on every read (and, with `uploads`, every upload); counts ``Tensor.to(device)`` calls."""

    def __init__(self, *, forbid: bool = True, uploads: bool = True) -> None:
        super().__init__()
        self.forbidden = (READS | (UPLOADS if uploads else set())) if forbid else set()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.forbidden and not sys._getframe(1).f_code.co_filename.startswith(_OPTIM):
            raise AssertionError(f"{getattr(func, '__qualname__', func)} in a steady-state step: a host synchronisation")
        if func is torch.Tensor.to and _names_a_device(args[1:], kwargs or {}):
            self.copies += 1
        return func(*args, **(kwargs or {}))
