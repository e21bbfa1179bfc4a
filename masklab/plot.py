"""One PNG per mask: the mask matrix, the mixing-graph spectrum and the mixing graph itself.

matplotlib is imported inside the function (Agg backend), so importing masklab stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import scipy.linalg

from masklab import analysis
from masklab.errors import MaskError
from masklab.io import atomic_write
from masklab.mask import Mask

MAX_SPECTRUM = 2048  # full spectra beyond this many workers are not worth a dense solve for a plot
MAX_DRAWN_NODES = 128


def plot_mask(mask: Mask, path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Draw `mask` into a PNG at `path` and return the path.

    The graph panel draws the mixing graph with a seeded spring layout (edge width ~ a_kl); for
    more than 128 workers it says so instead of drawing an unreadable hairball.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise MaskError(f"plot file {path} must end in .png")
    if not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise MaskError(f"plot file {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise MaskError(f"plot file {path} is a directory")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    fig, (ax_m, ax_s, ax_g) = plt.subplots(1, 3, figsize=(15, 4.8))
    ax_m.imshow(mask.matrix, aspect="auto", interpolation="nearest", cmap="Greys")
    ax_m.set_xlabel("block j")
    ax_m.set_ylabel("worker k")
    ax_m.set_title(f"mask: K={mask.workers}, B={mask.blocks}, C={mask.active_fraction:.3f}")

    gap = analysis.spectral_gap(mask)
    bound = analysis.spectral_gap_bound(mask)
    if mask.workers <= MAX_SPECTRUM:
        lap = analysis.mixing_laplacian(mask).toarray()
        eig = scipy.linalg.eigh(lap, eigvals_only=True)
        ax_s.plot(np.arange(eig.size), eig, "o", ms=3)
    else:
        ax_s.text(0.5, 0.5, f"K = {mask.workers}: full spectrum not drawn", ha="center",
                  transform=ax_s.transAxes)
    ax_s.axhline(gap, color="C1", label=f"gap = {gap:.4g}")
    ax_s.axhline(bound, color="C2", ls="--", label=f"trace bound = {bound:.4g}")
    ax_s.set_xlabel("index")
    ax_s.set_ylabel("eigenvalue of L(M)")
    ax_s.set_title("mixing-graph Laplacian spectrum")
    ax_s.legend(loc="lower right")

    if mask.workers <= MAX_DRAWN_NODES:
        g = analysis.to_networkx(mask)
        pos = nx.spring_layout(g, seed=seed)
        weights = np.array([d["weight"] for _, _, d in g.edges(data=True)]) if g.number_of_edges() else np.array([])
        widths = 0.5 + 3.0 * weights / weights.max() if weights.size else []
        nx.draw_networkx(g, pos=pos, ax=ax_g, node_size=120, font_size=7, width=widths,
                         edge_color="0.6", with_labels=mask.workers <= 32)
    else:
        ax_g.text(0.5, 0.5, f"K = {mask.workers}: graph too large to draw", ha="center",
                  transform=ax_g.transAxes)
    ax_g.set_title("worker mixing graph")
    ax_g.set_axis_off()
    fig.suptitle(f"{mask.construction or 'mask'} ({mask.schedule.kind})")
    fig.tight_layout()
    try:  # a failed save never leaves a truncated PNG at `path`
        return atomic_write(path, lambda name: fig.savefig(name, format="png", dpi=110))
    finally:
        plt.close(fig)
