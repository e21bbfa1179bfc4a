"""Predictions before a run: ``sdp plan`` (memory, communication, costs) and ``sdp estimate``.

`memory` predicts each rank's peak from the model's structure (with `activations`), `comm` the
bytes and process groups per step, `costs` what holding each block costs and which masks fit
given devices, and `constants` measures the problem constants that ``sdp verify`` takes.
"""
