"""Measured peak memory per rank, broken into parameters / gradients / optimizer / activations / other.

On CPU the figures come from torch's ``MemTracker`` (a dispatch mode that attributes every live
tensor storage to a category), so they are deterministic, with one exception: gloo's worker thread
drops its reference to a collective's output only after it has woken the caller, so an output
(FSDP's all-gather of a block) is now and then freed a moment late and counted in the peak.
The tracker is entered once per measured step and its module statistics are reset between
steps. Its "peak" snapshot is the breakdown at the moment the total peaks (usually in backward,
when activations are already being freed, or in the optimizer step), so the activation figure is
the largest activation total seen in any per-module snapshot of the step instead; it may peak at
another moment than the total.

On CUDA the total is ``torch.cuda.max_memory_allocated``; parameters, gradients and optimizer
state are the bytes of those live tensors; activations are the rest of the allocator's peak;
``device_used`` (from ``torch.cuda.mem_get_info``) adds what lives outside PyTorch's allocator,
such as NCCL's buffers.

`MemoryMeter.peak` (what ``summary.json`` reports per rank as ``peak_memory_bytes``) holds
``total`` and the breakdown ``parameters``, ``gradients``, ``optimizer`` (state, plus the
optimizer step's temporaries when the peak falls inside it), ``activations`` and ``other``
(buffers, backward temporaries, the sync engine's buckets), and ``persistent``: the parameters,
gradients and optimizer state held between steps. Every category is in bytes.

Not here: estimating memory from a model config. `analytic_bytes` counts the parameters,
gradients and optimizer state of a built model from their shapes, to cross-check the tracker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import copy
import functools
import importlib

import torch
from torch import nn

from sdp_train.parallel.grads import local

# torch's memory tracker pulls in dynamo, DTensor, sympy and triton: seconds of every process that
# imports it. A run that measures on CPU imports it before any process group exists
# (`sdp_train.trainer.launch.init_distributed`'s ``preload``): imported while a group exists it keeps
# that group, and its gloo threads, alive to interpreter shutdown (tests/distributed/test_teardown.py).
TRACKER_MODULE = "torch.distributed._tools.mem_tracker"

CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer", "activations", "other")
PERSISTENT: tuple[str, ...] = ("parameters", "gradients", "optimizer")
_REFS_OF = {  # our category -> the names of MemTracker's reference types (`_MemRefType`)
    "parameters": ("PARAM",),
    "gradients": ("GRAD",),
    "optimizer": ("OPT",),
    "activations": ("ACT",),
    "other": ("BUFFER", "TEMP", "OTH"),
}


def _category(snapshot: dict, category: str) -> int:
    refs = _tracker_module()._MemRefType
    return sum(snapshot.get(getattr(refs, ref), 0) for ref in _REFS_OF[category])


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    """numel x element size, summed; a DTensor (FSDP) counts its local shard."""
    return sum(t.numel() * t.element_size() for t in map(local, tensors))


def analytic_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state a model and optimizer hold now,
    counted from their shapes and dtypes (the cross-check of the tracker's figures)."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(state),
    }


class MemoryMeter:
    """Peak memory of one rank over the steps run inside `measure`.

    Parameters
    ----------
    model : nn.Module
        This rank's model (the unwrapped one; DDP's wrapper is not needed).
    optimizer : torch.optim.Optimizer
    device : torch.device
    extra : iterable of Tensor
        Long-lived tensors allocated before tracking starts that are neither parameters,
        gradients nor optimizer state (e.g. the sync engine's bucket buffers); counted as other.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 extra: Iterable[torch.Tensor] = ()) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.peak: dict[str, int] = {}
        self.tracker = None
        if device.type != "cuda":
            self.tracker = _tracker_class()()
            self.tracker.track_external(model, optimizer, *extra)

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Track one step; the running peak over all measured steps is in `peak`."""
        if self.tracker is None:
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self._merge(*self._cuda_step())
            return
        self.tracker.reset_mod_stats()
        with self.tracker:
            yield
            # a mask change (a schedule) made parameters and moved optimizer state inside the step: file
            # them, and let go of the hooks on those it freed (they would keep them alive)
            self.tracker.forget_missing(self.model)
            self.tracker.track_external(self.model, self.optimizer)
        current = next(iter(self.tracker.get_tracker_snapshot("current").values()), {})
        self._merge(self._tracker_step(), {c: _category(current, c) for c in PERSISTENT})

    def _merge(self, step: dict[str, int], persistent: dict[str, int]) -> None:
        activations = max(step["activations"], self.peak.get("activations", 0))
        if not self.peak or step["total"] > self.peak["total"]:
            self.peak = dict(step)
        self.peak["activations"] = activations
        self.peak["persistent"] = persistent

    def _tracker_step(self) -> dict[str, int]:
        peak = self.tracker.get_tracker_snapshot("peak")
        snap = next(iter(peak.values()), {})
        out = {"total": snap.get("Total", 0), **{c: _category(snap, c) for c in CATEGORIES}}
        module_acts = [snapshot.get(_tracker_module()._MemRefType.ACT, 0)
                       for stats in self.tracker.memory_tracking.values()
                       for states in stats.snapshots.values() for per_device in states
                       for snapshot in per_device.values()]
        # ACT in the peak snapshot also counts tensors made outside any forward (gradient
        # clipping, sync temporaries): only the per-module snapshots see activations proper.
        out["activations"] = max(module_acts, default=0)
        return out

    def _cuda_step(self) -> tuple[dict[str, int], dict[str, int]]:
        counted = analytic_bytes(self.model, self.optimizer)
        total = torch.cuda.max_memory_allocated(self.device)
        free, capacity = torch.cuda.mem_get_info(self.device)
        step = {"total": total, **counted, "activations": max(0, total - sum(counted.values())), "other": 0,
                "device_used": capacity - free}
        return step, counted


def _tracker_module():
    return importlib.import_module(TRACKER_MODULE)


@functools.cache
def _tracker_class() -> type:
    """`_Tracker`, defined on first use (its base class is torch's MemTracker)."""
    return type("_Tracker", (_TrackerMixin, _tracker_module().MemTracker), {"__doc__": _TrackerMixin.__doc__})


class _TrackerMixin:
    """MemTracker that installs its gradient hooks only on parameters that get gradients.

    Bb-SDP freezes the parameters of non-held blocks, and a frozen tensor takes no hooks.
    """

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._track_grad),
                        param.register_post_accumulate_grad_hook(lambda p: self._track_grad(p.grad)),
                    )
        return sizes

    def forget_missing(self, module: nn.Module) -> None:
        """Remove the gradient hooks of parameters no longer in ``module``: hooks registered on a
        parameter keep it alive, so a block a worker freed at a mask change would stay allocated."""
        live = {id(p) for p in module.parameters()}
        for param in [p for p in self._param_to_grad_hook_handles.keys() if id(p) not in live]:
            for handle in self._param_to_grad_hook_handles.pop(param):
                handle.remove()

    def _track_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _tracker_module()._MemRefType.GRAD)

    def _update_peak_stats(self, peak_state) -> None:
        """torch's update after every operator, reading the tracked modules' statistics without
        dereferencing each module's weak reference (per operator, most of a measured step's host
        time). A module that died keeps its statistics here until collected; nothing reads them."""
        snap, parents = self._curr_mem_snap, self._mod_tracker.parents
        total = _tracker_module()._TOTAL_KEY
        for mod_stats in list(self.memory_tracking.data.values()):
            if mod_stats.mod_fqn in parents and peak_state in mod_stats.snapshots:
                for dev, dev_snap in snap.items():
                    if mod_stats.local_peak.get(dev, 0) < dev_snap[total]:
                        mod_stats.local_peak[dev] = dev_snap[total]
                        mod_stats.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
        for dev, dev_snap in snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[total]:
                self._peak_mem[dev] = dev_snap[total]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)


def format_bytes(n: int) -> str:
    """``n`` bytes as a short human-readable string (KiB/MiB/GiB); a negative ``n`` (a saving that is a
    cost, as Bb-SDP's against DDP) keeps its sign in front of the same unit."""
    if n < 0:
        return "-" + format_bytes(-n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
