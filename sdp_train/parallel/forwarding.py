"""A wrapper's ``forward`` that shows the wrapped model's signature to `inspect.signature`.

Hugging Face's Trainer keeps only the batch columns that ``inspect.signature(model.forward)`` names,
and ``forward(*args, **kwargs)`` names none; both wrappers (`SubnetworkDataParallel`,
`OverlapAveraging`) use this descriptor so that their forward reads as the model's.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn


class ForwardWithModelSignature:
    """A ``forward`` method bound with the wrapped model's signature (``wrapper._forward_signature``).

    A fresh ``functools.partial`` per access carries the signature without the wrapper holding a
    reference to itself (it stays freed when dropped).
    """

    def __init__(self, function) -> None:
        self.function = function
        functools.update_wrapper(self, function)

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self.function
        bound = functools.partial(self.function, wrapper)
        signature = wrapper.__dict__.get("_forward_signature")
        if signature is not None:
            bound.__signature__ = signature
        return bound


def signature_of(module: nn.Module) -> inspect.Signature | None:
    """The signature of ``module.forward``, or None where Python cannot tell it (a builtin)."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
