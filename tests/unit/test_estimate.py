"""`sdp estimate`: per-block constants from per-worker gradients, checked against known truths.

The estimator tests feed Gaussian per-worker gradients whose noise and heterogeneity are known in
closed form; the command test runs llama-debug for 2 batches per worker and hands the file to
`sdp verify --constants`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masklab.io import load_mask
from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.planning.bootstrap import bootstrap, gradient_constants, gram_matrices
from sdp_train.planning.constants import hessian_norm
from theory.constants import load_constants, load_constants_file
from theory.errors import TheoryError

SIZES = (20, 50, 30)  # coordinates of the three blocks


def _gaussian_gradients(means: np.ndarray, stds: np.ndarray, batches: int, seed: int) -> list:
    """gradients[k][s][j] = means[k, j] + stds[k, j] * N(0, I): per-coordinate std, block sizes SIZES."""
    rng = np.random.default_rng(seed)
    workers = means.shape[0]
    return [[[torch.from_numpy(means[k, j] + stds[k, j] * rng.standard_normal(d)) for j, d in enumerate(SIZES)]
             for _ in range(batches)] for k in range(workers)]


def _offsets(workers: int, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([[scale * rng.standard_normal(d) for d in SIZES] for _ in range(workers)], dtype=object)


def test_recovers_known_sigma_and_zeta_of_gaussian_worker_gradients():
    # truth: sigma_j^2 = max_k d_j std_kj^2 (A2 bounds every worker), zeta_j^2 = (1/K) sum_k ||mu_kj - mu_j||^2
    workers, batches = 4, 300
    means = _offsets(workers, 0.3, seed=1)
    stds = np.array([[0.5, 1.0, 2.0], [0.7, 1.0, 1.0], [0.4, 1.5, 0.5], [0.6, 0.8, 1.0]])
    c = gradient_constants(_gaussian_gradients(means, stds, batches, seed=2))
    sigma_true = (stds**2 * np.array(SIZES)).max(axis=0)
    zeta_true = [np.mean([np.sum((means[k, j] - np.mean(list(means[:, j]), axis=0)) ** 2) for k in range(workers)])
                 for j in range(len(SIZES))]
    # relative s.e. of a variance over (n - 1) d degrees of freedom is sqrt(2 / ((n - 1) d)) <= 1.9% here, and
    # over 40 seeds the zeta estimates' relative spread was 3.1%, 3.5%, 4.5% with means within 1% of the truth:
    # the tolerances are more than 3 s.e.
    np.testing.assert_allclose(c.sigma_sq, sigma_true, rtol=0.08)
    np.testing.assert_allclose(c.worker_sigma_sq, stds**2 * np.array(SIZES), rtol=0.08)
    np.testing.assert_allclose(c.zeta_sq, zeta_true, rtol=0.15)


def test_zeta_is_zero_on_iid_worker_gradients_within_noise():
    # iid workers: the unclipped estimate has mean 0 and s.e. about sqrt(2 (K-1) / d) / K * sigma^2 / n
    workers, batches = 4, 50
    means = np.array([[np.full(d, 0.7) for d in SIZES]] * workers, dtype=object)
    stds = np.ones((workers, len(SIZES)))
    c = gradient_constants(_gaussian_gradients(means, stds, batches, seed=3))
    se = np.array([math.sqrt(2 * (workers - 1) / d) / workers * d / batches for d in SIZES])
    assert np.all(np.abs(c.zeta_sq_unclipped) <= 5 * se)
    assert np.all(c.zeta_sq <= 5 * se) and np.all(c.zeta_sq >= 0)
    assert np.all(c.zeta_sq[c.zeta_sq_unclipped < 0] == 0)


@settings(max_examples=25, deadline=None)
@given(workers=st.integers(1, 4), batches=st.integers(2, 5), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_estimates_are_non_negative_and_invariant_under_permuting_workers_and_batches(workers, batches, seed, data):
    rng = np.random.default_rng(seed)
    means, stds = _offsets(workers, rng.uniform(0, 2), seed), rng.uniform(0, 2, (workers, len(SIZES)))
    grads = _gaussian_gradients(means, stds, batches, seed)
    order = data.draw(st.permutations(range(workers)))
    shuffled = [[grads[k][s] for s in data.draw(st.permutations(range(batches)))] for k in order]
    a, b = gradient_constants(grads), gradient_constants(shuffled)
    for field in ("sigma_sq", "zeta_sq", "grad_sq"):
        assert np.all(getattr(a, field) >= 0)
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(a.zeta_sq_unclipped, b.zeta_sq_unclipped, rtol=1e-9, atol=1e-12)
    if workers == 1:
        assert np.all(a.zeta_sq == 0)


def test_unequal_batch_counts_are_refused():
    g = [[[torch.ones(2)], [torch.zeros(2)]], [[torch.ones(2)], [torch.zeros(2)], [torch.ones(2)]]]
    with pytest.raises(ConfigError, match="worker 1 gave 3 batches, worker 0 gave 2"):
        gradient_constants(g)
    with pytest.raises(ConfigError, match="at least 2"):
        gradient_constants([[[torch.ones(2)]]])


def test_hessian_norm_is_the_largest_absolute_eigenvalue_of_a_quadratic():
    # indefinite Hessian with eigenvalues -4, 2, 1 in a rotated basis: L-smoothness needs |-4|
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    h = q @ torch.diag(torch.tensor([-4.0, 2.0, 1.0], dtype=torch.float64)) @ q.T
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    value, change = hessian_norm(lambda: 0.5 * x @ h @ x, [x], iters=60, seed=1)
    assert value == pytest.approx(4.0, rel=1e-6) and change < 1e-6
    short, _ = hessian_norm(lambda: 0.5 * x @ h @ x, [x], iters=2, seed=1)
    assert short <= 4.0 + 1e-12  # ||H v|| of a unit v never exceeds the spectral norm


ESTIMATE = ["estimate", "--model", "llama-debug", "--workers", "2", "--batch-size", "2", "--seq-len", "16",
            "--steps", "2", "--power-iters", "3", "--max-data-bytes", "10000", "--trajectory", "2", "--checkpoints", "2",
            "--resamples", "100"]


def test_estimate_on_llama_debug_writes_a_file_that_verify_reads(tmp_path, capsys):
    out, mask_out = tmp_path / "constants.json", tmp_path / "mask.json"
    assert main([*ESTIMATE, "--out", str(out), "--mask-out", str(mask_out)]) == 0
    printed = capsys.readouterr().out
    assert "ESTIMATES, not proved bounds" in printed and "95% upper confidence bound" in printed
    assert "power iteration" in printed and f"sdp verify {mask_out} --constants {out}" in printed
    mask = load_mask(mask_out)
    loaded = load_constants_file(out, mask)
    constants = loaded.constants
    data = json.loads(out.read_text())
    assert data["block_names"] == list(mask.block_names) == [f"layers.{i}" for i in range(4)]
    assert loaded.estimated and data["estimate"]["confidence_level"] == 0.95 and data["estimate"]["assumptions"]
    # the shared parameters are one more column, held by both workers
    assert loaded.mask.block_names[-1] == "shared" and loaded.mask.coverage[-1] == 2 and data["shared"]["sigma_sq"] > 0
    assert np.all(constants.sigma_sq > 0) and np.all(constants.grad_sq >= constants.sigma_sq / 2)
    assert constants.smoothness > 0
    assert 4.0 < constants.suboptimality < 7.0  # cross-entropy of an untrained byte model, about ln 256
    with pytest.raises(TheoryError, match="has a 'shared' column"):
        load_constants(out, mask)
    assert main(["verify", str(mask_out), "--constants", str(out), "--eta", "0.1", "--steps", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["constants"]["source"] == "file" and report["bound"] > 0
    assert report["estimated"] is True and report["guarantee"] is False
    assert main(["verify", str(mask_out), "--constants", str(out), "--eta", "0.1", "--steps", "100"]) == 0
    text = capsys.readouterr().out
    assert "ESTIMATED" in text and "not a guarantee" in text and "column 'shared'" in text


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--steps", "0"], "--steps 0: needs at least 2 batches per worker"),
    (["--power-iters", "0"], "--power-iters 0 must be >= 1"),
    (["--mode", "ddp"], "mode 'ddp' has no mask"),
    (["--out", "{missing}/c.json"], "does not exist"),
    (["--out", "{tmp}"], "is a directory"),
])
def test_bad_input_gives_one_line_and_exit_2(tmp_path, capsys, argv, message):
    argv = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in argv]
    out = ["--out", str(tmp_path / "c.json")] if "--out" not in argv else []
    assert main([*ESTIMATE, *argv, *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdp estimate: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "c.json").exists()


def _save_model(path, seed):
    from safetensors.torch import save_file

    from sdp_train.models import build_model, get_model_config

    state = build_model(get_model_config("llama-debug"), seed=seed).state_dict()
    save_file({n: t.contiguous() for n, t in state.items()}, str(path))
    return path


def test_estimate_at_a_saved_model_measures_that_model(tmp_path, capsys):
    """--at the seed's own initial model gives the initial point's constants exactly; another model differs."""
    def run(*extra):
        # at the point only (--trajectory 0): what --at changes is the point
        assert main([*ESTIMATE, "--power-iters", "1", "--trajectory", "0", "--out", str(tmp_path / "c.json"), "--json",
                     *extra]) == 0
        return json.loads(capsys.readouterr().out)

    initial = run()
    same = run("--at", str(_save_model(tmp_path / "seed0.safetensors", seed=0)))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _save_model(run_dir / "model.safetensors", seed=7)
    other = run("--at", str(run_dir))  # a run directory: its model.safetensors
    assert initial["point"] == "initial" and same["point"] == other["point"] == "given"
    for key in ("sigma_sq", "zeta_sq", "grad_sq", "initial_loss"):
        assert same[key] == initial[key]
    assert other["sigma_sq"] != initial["sigma_sq"] and other["initial_loss"] != initial["initial_loss"]


def test_estimate_at_a_file_of_another_model_is_refused(tmp_path, capsys):
    from safetensors.torch import save_file

    from sdp_train.models import build_model, get_model_config

    wrong = tmp_path / "vit.safetensors"
    save_file(build_model(get_model_config("vit-tiny"), seed=0).state_dict(), str(wrong))
    state = build_model(get_model_config("llama-debug"), seed=0).state_dict()
    name = next(iter(state))
    state[name] = state[name][:1].contiguous()
    shape = tmp_path / "shape.safetensors"
    save_file({n: t.contiguous() for n, t in state.items()}, str(shape))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    for at, message in ((wrong, "does not hold a llama-debug model: missing"), (shape, f"tensor {name} has shape"),
                        (garbage, "not a readable safetensors file"), (tmp_path / "none", "no such file"),
                        (tmp_path, "no such file (model.safetensors of a run directory)")):
        assert main([*ESTIMATE, "--out", str(tmp_path / "c.json"), "--at", str(at)]) == 2, at
        err = capsys.readouterr().err
        assert err.startswith("sdp estimate: error: --at ") and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "c.json").exists()


def test_bootstrap_upper_bound_of_sigma_covers_the_truth_at_about_its_level():
    # Gaussian gradients, 2 workers x 20 batches, 5 coordinates of std 1: sigma^2 = 5 for both workers; the
    # 95% bound (of the max over workers) covered it in 96% of 300 draws here; below 85% would mean a broken bound
    covered = 0
    for seed in range(300):
        grads = _gaussian_gradients(np.zeros((2, 3), dtype=object), np.ones((2, 3)), batches=20, seed=seed)
        boot = bootstrap(gram_matrices(grads), level=0.95, resamples=200, seed=seed)
        covered += bool(boot.upper.sigma_sq[0] >= SIZES[0])
    assert covered >= 0.85 * 300


def test_bootstrap_point_estimates_are_the_plain_estimates():
    grads = _gaussian_gradients(_offsets(3, 0.5, seed=4), np.ones((3, 3)), batches=6, seed=5)
    plain, boot = gradient_constants(grads), bootstrap(gram_matrices(grads), level=0.9, resamples=100, seed=0)
    np.testing.assert_allclose(boot.point.sigma_sq, plain.sigma_sq, rtol=1e-9)
    np.testing.assert_allclose(boot.point.zeta_sq, plain.zeta_sq_unclipped, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(boot.point.grad_sq, plain.grad_sq, rtol=1e-9)
