"""The CPU memory tracker against byte counts worked out by hand (one process, tiny models)."""

from __future__ import annotations

import torch
from torch import nn

from sdp_train.trainer.memory import MemoryMeter, analytic_bytes, format_bytes

BATCH, DIM, HIDDEN, CLASSES = 8, 16, 64, 10


def _mlp_steps(steps: int) -> tuple[MemoryMeter, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    meter = MemoryMeter(model, optimizer, torch.device("cpu"))
    inputs, targets = torch.randn(BATCH, DIM), torch.randint(0, CLASSES, (BATCH,))
    for _ in range(steps):
        with meter.measure():
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    return meter, model, optimizer


def test_tracker_parameters_gradients_and_optimizer_state_equal_the_analytic_byte_counts():
    meter, model, optimizer = _mlp_steps(2)
    n_params = DIM * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
    # AdamW: exp_avg and exp_avg_sq per parameter, plus one float32 step counter per tensor
    expected = {"parameters": 4 * n_params, "gradients": 4 * n_params, "optimizer": 4 * (2 * n_params + 4)}
    assert analytic_bytes(model, optimizer) == expected
    assert meter.peak["persistent"] == expected
    assert meter.peak["parameters"] == expected["parameters"]
    assert meter.peak["total"] >= sum(expected.values()) + meter.peak["activations"]


def test_tracker_activation_peak_is_the_largest_set_of_live_forward_outputs():
    meter, _, _ = _mlp_steps(1)
    # float32 outputs Linear (B, H) -> ReLU (B, H) -> Linear (B, C). ReLU saves its output for
    # backward, so the first Linear's output dies after ReLU: both (B, H) are alive during ReLU,
    # then ReLU's output and the logits. The input was made outside the tracker.
    assert meter.peak["activations"] == 4 * BATCH * max(2 * HIDDEN, HIDDEN + CLASSES)


def test_peak_is_the_maximum_over_measured_steps_and_the_first_step_has_no_optimizer_state_yet():
    one, _, _ = _mlp_steps(1)
    two, _, _ = _mlp_steps(2)
    assert two.peak["total"] > one.peak["total"]


def test_format_bytes_picks_the_largest_unit():
    assert (format_bytes(512), format_bytes(3 * 2**20), format_bytes(5 * 2**30)) == ("512 B", "3.0 MiB", "5.0 GiB")
    # `sdp plan`'s "saved vs DDP" of Bb-SDP is negative: it printed "-1126256 B"
    assert (format_bytes(-1126256), format_bytes(-512)) == ("-1.1 MiB", "-512 B")


def test_the_trackers_peaks_equal_torchs_memtracker_on_the_same_steps():
    """`MemoryMeter`'s tracker reads module statistics its own (faster) way: every peak, global and
    per module, must stay torch's."""
    import importlib

    from sdp_train.trainer.memory import TRACKER_MODULE, _tracker_class

    def run(tracker_type) -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU()),
                              nn.Linear(HIDDEN, CLASSES))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = tracker_type()
        tracker.track_external(model, optimizer)
        inputs, targets = torch.randn(BATCH, DIM), torch.randint(0, CLASSES, (BATCH,))
        for _ in range(2):
            tracker.reset_mod_stats()
            with tracker:
                nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
        modules = {s.mod_fqn: ({str(k): [{str(d): dict(v) for d, v in per.items()} for per in states]
                                for k, states in s.snapshots.items()}, dict(s.local_peak))
                   for s in tracker.memory_tracking.values()}
        return tracker.get_tracker_snapshot("peak"), modules

    ours, torchs = run(_tracker_class()), run(importlib.import_module(TRACKER_MODULE).MemTracker)
    assert len(ours[1]) == 7 and ours == torchs  # the root, its 4 children, the inner 2
