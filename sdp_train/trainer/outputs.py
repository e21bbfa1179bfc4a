"""The files a run leaves in ``--out`` beside metrics and checkpoints, and how every file there is written.

- ``mask.json``: the mask the run trains with, in masklab's mask file format (``sdp train --mask
  DIR/mask.json`` trains with it again, ``sdp inspect DIR/mask.json`` prints its certificate);
- ``certificate.json``: masklab's certificate of that mask (`masklab.analyze`, the keys of
  ``sdp inspect --json``: coverage, masking error, variance inflation, spectral gap against its
  bound, optimality ratio, co-training gap, each with the theorem that uses it); printed by
  `mask_lines` as properties of the mask, gamma's optimality ratio as a design figure (no
  stepwise theorem uses gamma, and no theorem covers ``sdp train``'s AdamW runs);
- ``model.safetensors``: the final full model, assembled from the workers' subnetworks as
  validation assembles it (each slice from its lowest-ranked holder), under the built-in model's
  own state-dict names; ``load_state_dict`` of that model takes it with every key matching.

Every file is written whole through `masklab.io.atomic_write` (an exclusive temporary beside it,
fsynced, renamed over the destination: never through a link planted in ``--out``, never seen
half-written); the model through the API's own export, `sdp_train.parallel.export.save_safetensors`.
Not here: metrics.jsonl and summary.json (`sdp_train.trainer.train`), checkpoints
(`sdp_train.trainer.checkpoint`), who owns the directory (`sdp_train.trainer.rundir`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sdp_train.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from masklab import Mask, MaskReport

MASK_FILE = "mask.json"
CERTIFICATE_FILE = "certificate.json"
MODEL_FILE = "model.safetensors"
_PRINTED_ROWS = (16, 64)  # masks up to this many workers x blocks are printed row by row


def save_mask_and_certificate(out: str | os.PathLike[str], mask: Mask) -> tuple[Path, Path, MaskReport]:
    """Write ``out/mask.json`` and ``out/certificate.json``; returns both paths and the certificate."""
    from masklab import analyze
    from masklab.io import atomic_write_text, mask_to_dict

    out = Path(out)
    report = analyze(mask)
    mask_path = atomic_write_text(out / MASK_FILE, json.dumps(mask_to_dict(mask), indent=1) + "\n")
    cert_path = atomic_write_text(out / CERTIFICATE_FILE, json.dumps(report.to_dict(), indent=1) + "\n")
    return mask_path, cert_path, report


def mask_lines(mask: Mask, report: MaskReport) -> list[str]:
    """The rows of a small mask (one line per worker) and its certificate in one line."""
    lines = []
    if mask.workers <= _PRINTED_ROWS[0] and mask.blocks <= _PRINTED_ROWS[1]:
        width = len(str(mask.workers - 1))
        lines += [f"  worker {k:>{width}}: {''.join('1' if x else '0' for x in row)}"
                  for k, row in enumerate(mask.matrix.tolist())]
    f = report.failures_survived
    lines.append(f"  redundancy (a property of the mask): every block keeps a holder after any {f} simultaneous worker "
                 f"loss{'es' * (f != 1)} (min coverage - 1); fatal: {report.fatal_sets_text}; a lost worker stops the "
                 "run, or with --max-restarts restarts it from the last checkpoint, or with --on-worker-loss continue "
                 "(B-SDP, N-SDP, Bb-SDP, overlap averaging) the survivors go on without rollback, with "
                 "--restore-coverage on a mask redesigned for them, with --max-rejoins until a replacement "
                 "takes the lost row back (RELIABILITY.md)")
    lines.append(f"  certificate (properties of the mask, not guarantees for this run: no theorem covers AdamW, warm-up, "
                 f"cosine decay or clipping): masking error {report.masking_error:.4g}, variance inflation "
                 f"{report.variance_inflation:.4g}, spectral gap {report.spectral_gap:.4g} of at most "
                 f"{report.spectral_gap_bound:.4g} (optimality ratio {report.optimality_ratio:.4g}; a design figure: "
                 f"no stepwise theorem uses gamma, overlap averaging contracts at the schedule's gap, docs/theory.md "
                 f"§8), co-training gap {report.cotraining_gap:.4g} (a diagnostic)")
    return lines


def check_can_save_model() -> None:
    """Refuse, before anything is launched, a run that could not write its final model."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ConfigError("saving the final model (model.safetensors) needs the safetensors package: "
                          "pip install safetensors, or pass --no-save") from None


def save_model(out: str | os.PathLike[str], state: Mapping[str, torch.Tensor], *, config: object | None = None
               ) -> Path:
    """Write the full model's state dict to ``out/model.safetensors``; returns the path.

    With a Hugging Face ``config`` (a user model's ``.config``), ``out/config.json`` is written too,
    so ``from_pretrained(out)`` loads the trained model.
    """
    from sdp_train.parallel.export import save_safetensors

    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
    return save_safetensors(state, Path(out) / MODEL_FILE)
