"""Hugging Face's ``Trainer`` training a `SubnetworkDataParallel` model: `SDPTrainer` (docs/api.md).

Run under torchrun with the default process group initialised before the model is wrapped. The
wrapper is the data parallelism: `SDPTrainer` hands Trainer the wrapped model as ``model`` (its
inputs, labels and config) and the wrapper as ``model_wrapped``, so neither Trainer nor Accelerate
wraps it again in DDP (whose all-reduce over every rank's different parameters cannot work). It
clips and measures the gradient norm with the wrapper's global norm, registers the optimizer
(backward masking, schedules) and saves the full model (`save_full`, a collective) where Trainer
would save one rank's part. It overrides Trainer's ``_wrap_model``, ``_clip_grad_norm`` and
``_get_grad_norm`` as transformers 5.24 names them (the ``dev`` extra pins transformers < 5.25).

Not here: resuming Trainer checkpoints (Trainer writes rank 0's optimizer state only; ``sdp train``
has resumable checkpoints), ``generate`` (reload the saved model), the wrapper itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from sdp_train.errors import ConfigError
from sdp_train.parallel.wrapper import SubnetworkDataParallel

try:
    from transformers import Trainer
    from transformers.trainer import TRAINING_ARGS_NAME
except ImportError as exc:  # transformers, or the accelerate its Trainer needs
    raise ImportError(f"sdp_train.integrations.hf needs transformers<5.25 and accelerate ({exc}): "
                      "pip install 'transformers<5.25' accelerate") from exc


REFUSED = {"activation_checkpointing": "pass activation_checkpointing=True to SubnetworkDataParallel",
           "gradient_checkpointing": "pass activation_checkpointing=True to SubnetworkDataParallel",
           "load_best_model_at_end": "the best checkpoint is a full model: reload it with from_pretrained",
           "push_to_hub": "push the directory that trainer.save_model(dir) writes"}
"""TrainingArguments `SDPTrainer` refuses when true -> what to do instead."""


class SDPTrainer(Trainer):
    """``transformers.Trainer`` for a `SubnetworkDataParallel` model; every other argument is Trainer's.

    >>> # under torchrun, after torch.distributed.init_process_group("gloo")
    >>> # model = SubnetworkDataParallel(LlamaForCausalLM(config), active=0.5)
    >>> # trainer = SDPTrainer(model=model, args=TrainingArguments(...), train_dataset=...)
    >>> # trainer.train(); trainer.save_model("out")   # every rank; from_pretrained("out") loads it

    ``trainer.model`` is this worker's part of the model and ``trainer.model_wrapped`` the wrapper,
    as with DDP. Refused, each with one error: a ``model`` that is not a `SubnetworkDataParallel`,
    ``model_init``, Trainer's activation checkpointing (use the wrapper's
    ``activation_checkpointing=True``, which checkpoints held blocks only), ``load_best_model_at_end``
    and ``push_to_hub`` (both would read or send one worker's part), and ``resume_from_checkpoint``.
    """

    def __init__(self, model: SubnetworkDataParallel | None = None, args=None, **kwargs) -> None:
        if not isinstance(model, SubnetworkDataParallel):
            raise ConfigError(f"SDPTrainer trains a SubnetworkDataParallel model, got model={type(model).__name__}; "
                              "wrap it first: SubnetworkDataParallel(model, active=...)")
        if kwargs.get("model_init") is not None:
            raise ConfigError("SDPTrainer takes the wrapped model, not model_init: every rank must wrap the same "
                              "model before the trainer is built")
        for name, instead in REFUSED.items():  # before Trainer acts on them (push_to_hub creates a repository)
            if getattr(args, name, False):
                raise ConfigError(f"SDPTrainer: TrainingArguments({name}=True) is not supported: {instead}")
        super().__init__(model=model.module, args=args, **kwargs)
        self.model_wrapped = model
        self._registered_optimizer: torch.optim.Optimizer | None = None

    @property
    def sdp(self) -> SubnetworkDataParallel:
        """The `SubnetworkDataParallel` wrapper being trained."""
        return self.model_wrapped

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint:
            raise ConfigError(f"SDPTrainer cannot resume from a Trainer checkpoint (resume_from_checkpoint="
                              f"{resume_from_checkpoint!r}): Trainer saves rank 0's optimizer state only, and each "
                              "worker holds other blocks. Start from the saved full model, or use sdp train")
        return super().train(None, *args, **kwargs)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """The wrapper, for training and evaluation: no DataParallel, no DDP around it."""
        return self.model_wrapped

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """Trainer's optimizer, registered with the wrapper once. Under a schedule with backward
        masking it holds every parameter: a block's new holders step it with the optimizer they have,
        and Trainer's holds only those that require gradients now (torch's skip those without one)."""
        sdp = self.model_wrapped
        every = self.optimizer is None and sdp.cut.keeps_whole_model and not sdp.mask.schedule.is_static
        with _every_parameter_trainable(sdp.module) if every else contextlib.nullcontext():
            optimizer = super().create_optimizer(model)
        if optimizer is not self._registered_optimizer:
            self.model_wrapped.register_optimizer(optimizer)
            self._registered_optimizer = optimizer
        return optimizer

    def _clip_grad_norm(self, model):
        """The global norm over every block once, one factor on every rank (holders stay identical)."""
        return self.model_wrapped.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.model_wrapped.grad_norm()
        return super()._get_grad_norm(model, grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the full model (``model.safetensors`` and ``config.json``) that ``from_pretrained``
        loads; every rank must call it (Trainer's own checkpoints do), rank 0 writes."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        self.model_wrapped.save_full(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


@contextlib.contextmanager
def _every_parameter_trainable(module: nn.Module) -> Iterator[None]:
    """Every parameter of `module` requires gradients inside; each gets its own flag back after."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


__all__ = ["SDPTrainer"]
