"""`sdp plan`'s memory model: closed forms, invariants in C and K, the activation formulas against
the tensors autograd really saves, size parsing and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from masklab import Mask, save_mask
from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.models import block_map, build_model, get_model_config, model_class, num_params
from sdp_train.models.subnet import apply_backward_mask, build_worker_model
from sdp_train.planning.activations import activation_model
from sdp_train.planning.memory import NCCL_COMMUNICATOR_BYTES, meaningful_actives, parse_bytes, plan_systems, predict
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import design_for_model

LLAMA = dict(batch_size=8, seq_len=64)
TINY_VIT = {"dim": 32, "n_heads": 2, "hidden_dim": 64, "n_layers": 4, "patch_size": 2, "in_channels": 1}
TINY_RESNET = {"width_multiplier": 0.125, "in_channels": 1}


def test_ddp_state_is_the_model_numel_times_four_plus_adamw_moments():
    p = predict("llama-debug", mode="ddp", workers=4, **LLAMA)
    numel = num_params(get_model_config("llama-debug"))
    n_tensors = len(block_map(get_model_config("llama-debug")).parameter_names)
    assert p["persistent"] == {"parameters": 4 * numel, "gradients": 4 * numel, "optimizer": 8 * numel + 4 * n_tensors}


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
def test_sdp_at_c_1_predicts_exactly_ddp(mode):
    ddp = predict("llama-debug", mode="ddp", workers=4, **LLAMA)
    sdp = predict("llama-debug", mode=mode, workers=4, active=1.0, **LLAMA)
    for key in ("total", "persistent", "activations", "parameters", "gradients", "optimizer"):
        assert sdp[key] == ddp[key], key


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp"])
@pytest.mark.parametrize("ac", [False, True])
def test_peak_is_monotone_in_the_active_fraction(mode, ac):
    totals = [predict("llama-debug", mode=mode, workers=4, active=c, ac=ac, **LLAMA)["total"]
              for c in meaningful_actives(4)]
    assert totals == sorted(totals) and totals[0] < totals[-1], totals


def test_fsdp_divides_the_state_by_the_workers_and_pads_uneven_rows():
    ddp = predict("llama-debug", mode="ddp", workers=4, **LLAMA)["persistent"]
    fsdp = predict("llama-debug", mode="fsdp", workers=4, **LLAMA)["persistent"]
    assert fsdp["parameters"] == ddp["parameters"] // 4 and fsdp["gradients"] == ddp["gradients"] // 4
    three = predict("llama-debug", mode="fsdp", workers=3, **LLAMA)["persistent"]
    assert ddp["parameters"] / 3 < three["parameters"] < ddp["parameters"] / 3 * 1.02  # dim 0 padded to 3 | rows


def test_sdp_with_fsdp_at_half_coverage_stores_what_fsdp_stores():
    # every block on 2 of 4 workers, sharded between them: one block's worth per rank, as FSDP over 4
    fsdp = predict("llama-debug", mode="fsdp", workers=4, **LLAMA)
    both = predict("llama-debug", mode="bsdp", fsdp=True, workers=4, active=0.5, **LLAMA)
    assert both["persistent"]["parameters"] == fsdp["persistent"]["parameters"]
    assert both["total"] < fsdp["total"]


def test_holder_fsdp_keeps_one_block_unsharded_beside_the_root_and_fsdps_parameters_and_gradients():
    # resharded after forward, gathered again in backward, nothing prefetched (docs/design.md §5)
    bmap = block_map(get_model_config("llama-debug"))
    root = 4 * _numel(n for n in bmap.shared("block") if n in bmap.parameter_names)
    block = 4 * _numel(n for n, _ in bmap.owned("block", 0))
    for ac in (False, True):
        fsdp = predict("llama-debug", mode="fsdp", workers=4, ac=ac, **LLAMA)
        both = predict("llama-debug", mode="bsdp", fsdp=True, workers=4, active=0.5, ac=ac, **LLAMA)
        for state in ("parameters", "gradients"):  # (AdamW's step counters: one per tensor a rank holds)
            assert both["persistent"][state] == fsdp["persistent"][state]
        assert both["parameters"] - both["persistent"]["parameters"] <= root + block
        assert both["total"] < fsdp["total"]


def test_checkpointing_lowers_every_mode_and_sharding_lowers_sdp():
    for mode in ("ddp", "fsdp", "bsdp", "nsdp", "bbsdp"):
        plain = predict("llama-debug", mode=mode, workers=4, **LLAMA)
        ac = predict("llama-debug", mode=mode, workers=4, ac=True, **LLAMA)
        assert ac["total"] < plain["total"] and ac["persistent"] == plain["persistent"], mode
    assert (predict("llama-debug", mode="bsdp", fsdp=True, workers=4, **LLAMA)["total"]
            < predict("llama-debug", mode="bsdp", workers=4, **LLAMA)["total"])


def test_worker_holdings_are_those_of_the_mask_sdp_train_designs():
    config = get_model_config("llama-debug")
    for mode, level in (("bsdp", "block"), ("nsdp", "neuron")):
        mask = design_for_model(TrainConfig(mode=mode, workers=4, active=0.5), config)
        held = [sum(p.numel() for p in build_worker_model(config, mask.matrix[r], level, seed=0).parameters())
                for r in range(4)]
        assert predict(config, mode=mode, workers=4, active=0.5, **LLAMA)["persistent"]["parameters"] == 4 * max(held)


def test_a_given_mask_replaces_the_design_and_the_largest_rank_is_reported(tmp_path):
    mask = Mask(np.array([[1, 0, 0, 0], [1, 1, 1, 1]]))
    p = predict("llama-debug", mode="bsdp", workers=2, mask=mask, **LLAMA)
    assert p["rank"] == 1 and p["per_rank"][0] < p["per_rank"][1] == p["total"]
    # rank 1 holds every block: its sync buckets cost what DDP's reducer buckets do
    assert p["total"] == predict("llama-debug", mode="ddp", workers=2, **LLAMA)["total"]
    assert predict("llama-debug", mode="bsdp", workers=2, mask=save_mask(mask, tmp_path / "m.json"),
                   **LLAMA)["total"] == p["total"]
    with pytest.raises(ConfigError, match=r"the mask is 2 x 4 but llama-debug with 3 workers needs 3 x 4"):
        predict("llama-debug", mode="bsdp", workers=3, mask=mask, **LLAMA)


def test_lower_precision_halves_the_state_and_the_activations():
    f32 = predict("llama-debug", mode="bsdp", workers=4, **LLAMA)
    bf16 = predict("llama-debug", mode="bsdp", workers=4, dtype="bfloat16", **LLAMA)
    assert bf16["persistent"]["parameters"] * 2 == f32["persistent"]["parameters"]
    assert bf16["activations"] < 0.51 * f32["activations"] + 50_000  # the int64 batch and float32 RoPE stay


def _saved_bytes(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward (parameters and buffers excluded)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return sum(seen.values())


def _worker(config, kind: str, seed: int):
    """A full, block-masked, neuron-masked or backward-masked (frozen) model and its frozen blocks."""
    bmap = block_map(config)
    rng = np.random.default_rng(seed)
    if kind == "full":
        return build_model(config, seed=0), frozenset()
    if kind == "frozen":
        row = np.resize([1, 0], bmap.num_blocks("block"))
        model = build_model(config, seed=0)
        apply_backward_mask(model, config, row)
        return model, frozenset(n for n, h in zip(bmap.block_names("block"), row) if not h)
    row = rng.integers(0, 2, bmap.num_blocks(kind))
    row[0] = 1
    if kind == "neuron":
        row = row.reshape(-1, config.neuron_groups)
        if hasattr(config, "channels"):  # a ResNet block keeps at least one channel group
            row[:, 0] = 1
        else:  # a LLaMA / ViT layer may lose its whole MLP
            row[0, :], row[1, 0] = 0, 1
        row = row.reshape(-1)
    return build_worker_model(config, row, kind, seed=0), frozenset()


@pytest.mark.parametrize("kind", ["full", "block", "neuron", "frozen"])
@pytest.mark.parametrize(("name", "overrides", "side"),
                         [("llama-debug", {}, None), ("vit-tiny", TINY_VIT, 8), ("resnet18-cifar", TINY_RESNET, 8),
                          ("resnet18-cifar", {"width_multiplier": 0.125}, 32), ("swin-debug", {"in_channels": 1}, 8),
                          ("swin-debug", {"image_size": 32, "depths": (1, 2, 1), "heads": (1, 2, 2)}, 32)])
def test_activation_formulas_equal_the_bytes_autograd_saves(name, overrides, side, kind):
    config = get_model_config(name, **overrides)
    model, frozen = _worker(config, kind, seed=len(name) + len(kind))
    batch = 4
    if side is None:
        seq_len = 32
        inputs = torch.randint(0, config.vocab_size, (batch, seq_len))
        targets = torch.randint(0, config.vocab_size, (batch, seq_len))
    else:
        seq_len = 1
        inputs = torch.randn(batch, config.in_channels, side, side)
        targets = torch.randint(0, config.num_classes, (batch,))
    acts = activation_model(model, frozen, batch_size=batch, seq_len=seq_len, image_size=side or 8, elem=4)
    # the formulas leave out the loss's 4-byte total weight
    assert acts.forward_bytes(ac=False) == pytest.approx(_saved_bytes(model, inputs, targets), abs=8)



@pytest.mark.parametrize("kind", ["full", "block"])
@pytest.mark.parametrize(("name", "params"), [("wideresnet18-cifar", 44_662_922), ("swin-tiny", 27_504_916)])
def test_the_papers_image_models_at_their_real_size_are_planned_as_autograd_saves(name, params, kind):
    """WideResNet-18 (width 2) and Swin-T for 32 x 32 images as built-ins: sdp plan's activation
    formulas equal the bytes autograd saves at full size, and its parameters are the model's."""
    config = get_model_config(name)
    assert num_params(config) == params
    model, frozen = _worker(config, kind, seed=3)
    inputs, targets = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    acts = activation_model(model, frozen, batch_size=2, seq_len=1, image_size=32, elem=4)
    assert acts.forward_bytes(ac=False) == pytest.approx(_saved_bytes(model, inputs, targets), abs=8)
    if kind == "full":
        ddp = predict(name, mode="ddp", workers=2, batch_size=2, image_size=32)
        assert ddp["persistent"]["parameters"] == 4 * params


@pytest.mark.parametrize("row", [[0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 1]])
def test_swin_patch_merging_bytes_count_where_the_worker_keeps_them(row):
    """A patch merging keeps its own tensors but not its input: they are the stem's when the worker
    holds no block before it, and the first stage's last block output is not kept."""
    config = get_model_config("swin-debug", in_channels=1)
    model = build_worker_model(config, np.array(row), "block", seed=0)
    inputs, targets = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    acts = activation_model(model, frozenset(), batch_size=4, seq_len=1, image_size=8, elem=4)
    assert acts.forward_bytes(ac=False) == pytest.approx(_saved_bytes(model, inputs, targets), abs=8)

@pytest.mark.parametrize("side", [8, 32])
def test_skipped_downsampling_blocks_count_the_bytes_autograd_saves(side):
    """relu(bn(conv1x1 x)) of every stage entry the worker does not hold: BatchNorm input and
    statistics and the output, whether or not the blocks after it are held."""
    config = get_model_config("resnet18-cifar", **TINY_RESNET)
    model = build_worker_model(config, np.array([1, 1, 0, 1, 0, 0, 0, 1]), "block", seed=0)
    inputs, targets = torch.randn(4, 1, side, side), torch.randint(0, 10, (4,))
    acts = activation_model(model, frozenset(), batch_size=4, seq_len=1, image_size=side, elem=4)
    skipped = [b.saved for b in acts.blocks if b.name in ("layer2.0", "layer3.0", "layer4.0")]
    assert skipped == [0, 0, 0] and "layer3.1" not in [b.name for b in acts.blocks]  # pass-throughs keep outputs
    assert acts.forward_bytes(ac=False) == pytest.approx(_saved_bytes(model, inputs, targets), abs=8)


def test_activation_bytes_scale_with_tokens():
    small = predict("llama-134m", mode="ddp", workers=2, batch_size=1, seq_len=256, loss_chunks=0)["activations"]
    large = predict("llama-134m", mode="ddp", workers=2, batch_size=4, seq_len=256, loss_chunks=0)["activations"]
    assert 3.99 < large / small < 4.0
    # the chunked loss keeps the head weight's gradient, V d, whatever the tokens, instead of N V
    chunked = [predict("llama-134m", mode="ddp", workers=2, batch_size=b, seq_len=256)["activations"] for b in (1, 4)]
    assert chunked[1] - chunked[0] == large - small - 4 * 3 * 256 * 32000


def test_bad_inputs_are_refused_naming_the_value():
    with pytest.raises(ConfigError, match="mode 'zero3'"):
        predict("llama-debug", mode="zero3", workers=4)
    with pytest.raises(ConfigError, match="gpt-9"):
        predict("gpt-9", mode="ddp", workers=4)
    with pytest.raises(ConfigError, match="dtype 'int8'"):
        predict("llama-debug", mode="ddp", workers=4, dtype="int8")
    with pytest.raises(ConfigError, match="seq_len=4096 exceeds"):
        predict("llama-debug", mode="ddp", workers=4, seq_len=4096)
    with pytest.raises(ConfigError, match="workers=0"):
        predict("llama-debug", mode="ddp", workers=0)


def test_meaningful_actives_are_the_coverages_k_realises():
    assert meaningful_actives(4) == [0.25, 0.5, 0.75, 1.0]
    assert meaningful_actives(2) == [0.5, 1.0]
    assert meaningful_actives(16) == [0.25, 0.375, 0.5, 0.6875, 1.0]


@pytest.mark.parametrize(("text", "expected"), [
    ("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("80gb", 80 * 10**9), ("1.5 MiB", 3 * 2**19), ("4096", 4096),
    (4096, 4096), (" 512 KiB ", 512 * 1024), ("2TB", 2 * 10**12), ("100b", 100), ("1e9", 10**9),
])
def test_sizes_parse_in_si_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "-5GB", "0", "12XB", "GiB", "1.2.3GB", True])
def test_bad_sizes_are_refused_naming_the_value(text):
    with pytest.raises(ConfigError) as err:
        parse_bytes(text)
    assert repr(text) in str(err.value)


def test_plan_rows_list_every_system_and_which_fit():
    rows = plan_systems("llama-debug", workers=4, memory_per_device=30 * 2**20, fsdp=True, **LLAMA)
    systems = [(r["system"], r["active"]) for r in rows]
    assert systems[:2] == [("DDP", 1.0), ("FSDP", 1.0)]
    assert ("B-SDP+FSDP", 0.25) in systems and ("Bb-SDP", 0.75) in systems and len(systems) == 2 + 4 * 4
    for r in rows:
        assert r["fits"] == (r["total"] <= 30 * 2**20)
    assert {r["system"] for r in rows if r["fits"]} >= {"B-SDP", "B-SDP+FSDP"}
    assert not next(r for r in rows if r["system"] == "DDP")["fits"]


def test_plan_marks_a_c_that_cannot_be_designed():
    # 2 blocks, 4 workers, C = 0.25: one holder per block leaves two workers empty
    rows = plan_systems("llama-debug", workers=4, memory_per_device=2**30, actives=(0.25,),
                        model_overrides={"n_layers": 2}, **LLAMA)
    bsdp = next(r for r in rows if r["system"] == "B-SDP")
    assert bsdp["total"] is None and not bsdp["fits"] and bsdp["error"]


def test_cli_prints_the_table_and_the_systems_that_fit(capsys):
    assert main(["plan", "--model", "llama-debug", "--workers", "4", "--memory-per-device", "25MiB", "--ac"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "system" in lines[1] and "fits" in lines[1] and "activations" in lines[1]
    assert any(line.startswith("DDP+AC") and line.rstrip().endswith("no") for line in lines)
    assert any(line.startswith("B-SDP+AC") and line.rstrip().endswith("yes") for line in lines)
    assert lines[-1].startswith("fit: ") and "B-SDP+AC (C=0.25)" in lines[-1]


def test_cli_json_rows_match_predict(capsys):
    assert main(["plan", "--model", "llama-debug", "--workers", "2", "--memory-per-device", "1GB", "--json",
                 "--batch-size", "2", "--seq-len", "16", "--active", "0.5"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in rows] == ["DDP", "FSDP", "B-SDP", "N-SDP", "Bb-SDP"]
    assert all(r["fits"] for r in rows)
    assert rows[2]["total"] == predict("llama-debug", mode="bsdp", workers=2, active=0.5, batch_size=2,
                                       seq_len=16)["total"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--memory-per-device", "lots"], "memory size 'lots' is not a size"),
    (["--memory-per-device", "0GB"], "memory size '0GB' must be positive"),
    (["--memory-per-device", "1GB", "--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--memory-per-device", "1GB", "--active", "1.5"], "--active 1.5 must lie in (0, 1]"),
    (["--memory-per-device", "1GB", "--batch-size", "0"], "batch_size=0"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    base = ["plan", "--model", "llama-debug", "--workers", "4"]
    args = base + argv
    if "--model" in argv:
        args = ["plan", "--workers", "4", *argv]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp plan: error:") and message in err[0], err


def _numel(names) -> int:
    shapes = block_map(get_model_config("llama-debug")).shapes
    return sum(int(np.prod(shapes[n])) for n in names)


def test_ddp_and_fsdp_bytes_per_step_are_the_runtime_counts_and_fsdp_wire_is_1_5x_ddp():
    bmap = block_map(get_model_config("llama-debug"))
    params = [n for n in bmap.shapes if n in bmap.parameter_names]
    in_blocks = _numel(n for j in range(4) for n, _ in bmap.owned("block", j))
    ddp = predict("llama-debug", mode="ddp", workers=4, **LLAMA)
    fsdp = predict("llama-debug", mode="fsdp", workers=4, **LLAMA)
    assert ddp["comm_bytes_per_step"] == 4 * _numel(params) + 8
    assert ddp["wire_bytes_per_step"] == pytest.approx(1.5 * ddp["comm_bytes_per_step"])
    # as tests/distributed/test_fsdp_composition.py measures: gather all, gather the blocks and the
    # embedding again, reduce-scatter all
    again = in_blocks + _numel(["tok_embeddings.weight"])
    assert fsdp["comm_bytes_per_step"] == 4 * (2 * _numel(params) + again) + 8
    assert fsdp["wire_bytes_per_step"] == pytest.approx(0.75 * (fsdp["comm_bytes_per_step"] - 8) + 12)
    assert 1.4 < fsdp["wire_bytes_per_step"] / ddp["wire_bytes_per_step"] < 1.6


def test_bsdp_bytes_per_step_are_the_held_blocks_with_several_holders_and_their_ring_share():
    mask = np.array([[1, 1, 0, 0], [1, 0, 1, 1], [0, 1, 1, 0], [0, 1, 0, 1]], dtype=np.uint8)
    bmap = block_map(get_model_config("llama-debug"))
    shared = _numel(n for n in bmap.shared("block") if n in bmap.parameter_names)
    block = [_numel(n for n, _ in bmap.owned("block", j)) for j in range(4)]
    coverage = mask.sum(axis=0)
    per_rank = []
    for r in range(4):
        held = [j for j in range(4) if mask[r, j] and coverage[j] > 1]
        buffer = 4 * (shared + sum(block[j] for j in held)) + 8
        wire = 1.5 * (4 * shared + 8) + sum(2 * (coverage[j] - 1) / coverage[j] * 4 * block[j] for j in held)
        per_rank.append((wire, buffer))
    p = predict("llama-debug", mode="bsdp", workers=4, mask=Mask(mask), **LLAMA)
    wire, buffer = max(per_rank)
    assert p["comm_bytes_per_step"] == buffer
    assert p["wire_bytes_per_step"] == pytest.approx(wire)


def test_holder_fsdp_bytes_gather_each_shared_block_twice_and_a_single_holder_sends_nothing():
    mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=np.uint8)  # blocks 0 and 3: one holder each
    bmap = block_map(get_model_config("llama-debug"))
    root = 4 * _numel(n for n in bmap.shared("block") if n in bmap.parameter_names)
    embedding = 4 * _numel(["tok_embeddings.weight"])
    shared_blocks = 4 * _numel(n for j in (1, 2) for n, _ in bmap.owned("block", j))
    p = predict("llama-debug", mode="bsdp", fsdp=True, workers=2, mask=Mask(mask), **LLAMA)
    # the head's unit gathered once and reduced, the embedding's and blocks 1 and 2 gathered in forward
    # and backward and reduced
    assert p["comm_bytes_per_step"] == 2 * root + embedding + 3 * shared_blocks + 8
    assert p["wire_bytes_per_step"] == pytest.approx((p["comm_bytes_per_step"] - 8) / 2 + 8)


def test_what_no_mask_removes_is_the_same_at_every_c_and_sharded_over_all_ranks_with_fsdp():
    ddp = predict("llama-debug", mode="ddp", workers=4, ac=True, **LLAMA)["unmaskable"]
    fsdp = predict("llama-debug", mode="fsdp", workers=4, ac=True, **LLAMA)["unmaskable"]
    for c in meaningful_actives(4):
        assert predict("llama-debug", mode="bsdp", workers=4, active=c, ac=True, **LLAMA)["unmaskable"] == ddp
        assert predict("llama-debug", mode="bsdp", fsdp=True, workers=4, active=c, ac=True, **LLAMA)["unmaskable"] == fsdp
    # the root: DDP keeps it whole with gradients, AdamW moments and a bucket copy (4 + 4 + 8 + 4 B per
    # element); FSDP shards those but the bucket over 4 ranks and holds the head's unit (all but the
    # embedding) unsharded from its forward to its backward
    bmap = block_map(get_model_config("llama-debug"))
    root = _numel(n for n in bmap.shared("block") if n in bmap.parameter_names)
    head = root - _numel(["tok_embeddings.weight"])
    assert ddp - fsdp == 20 * root - (16 * root // 4 + 4 * head)


@pytest.mark.parametrize("mode", ["bsdp", "nsdp", "bbsdp", "fsdp"])
def test_evaluation_peak_adds_one_full_model_to_rank_zeros_state_only_where_rank_zero_lacks_it(mode):
    full = 4 * _numel(block_map(get_model_config("llama-debug")).shapes)
    p = predict("llama-debug", mode=mode, workers=4, active=0.5, **LLAMA)
    ddp = predict("llama-debug", mode="ddp", workers=4, **LLAMA)
    config = get_model_config("llama-debug")
    with torch.device("meta"):
        acts = activation_model(model_class(config)(config), frozenset(), elem=4,
                                image_size=8, loss_chunks=TrainConfig.loss_chunks, **LLAMA)
    forward = acts.stem + max(b.saved for b in acts.blocks) + acts.head + acts.loss_backward
    assert ddp["eval_peak"] == sum(ddp["persistent"].values()) + ddp["buffers"] + forward  # no second copy
    rank0_state = p["eval_peak"] - full - forward
    assert 0 < rank0_state <= sum(p["persistent"].values()) + p["buffers"]  # at most the largest rank's


@pytest.mark.parametrize(("mode", "fsdp", "active"), [("ddp", False, None), ("bsdp", False, 0.5), ("nsdp", False, 0.5),
                                                      ("bbsdp", False, 0.5), ("bsdp", True, 0.25)])
def test_a_cuda_plan_adds_each_ranks_communicators_at_the_per_communicator_bytes(monkeypatch, mode, fsdp, active):
    monkeypatch.setenv("SDP_NCCL_COMMUNICATOR_BYTES", "100MiB")
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "0")  # unshared: a communicator each (test_plan_communicators)
    cpu = predict("llama-debug", mode=mode, workers=4, active=active, fsdp=fsdp, **LLAMA)
    cuda = predict("llama-debug", mode=mode, workers=4, active=active, fsdp=fsdp, device="cuda", **LLAMA)
    assert cpu["communicators"] == 0 and cpu["communicator_bytes"] == 0  # gloo: host memory, not counted
    assert cuda["communicator_bytes"] == 100 * 2**20
    # every rank: the world's communicator and one per process group it belongs to
    assert cuda["process_groups"] == cpu["process_groups"]
    assert cuda["total"] - cpu["total"] == cuda["communicator_count"] * 100 * 2**20
    assert 1 <= cuda["communicator_count"] <= 1 + cuda["process_groups"]
    assert cuda["eval_peak"] > cpu["eval_peak"]
    for c, g in zip(cpu["per_rank"], cuda["per_rank"]):
        assert (g - c) % (100 * 2**20) == 0 and g > c
    others = ("parameters", "gradients", "optimizer", "activations", "other")
    assert {k: cuda[k] for k in others} == {k: cpu[k] for k in others}


def test_the_communicator_count_is_one_per_group_of_the_rank_plus_the_world(monkeypatch):
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "0")
    # holder sets {0,1} {0,2} {1,2}: every rank is in two groups, and in the world's
    mask = Mask(np.array([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=np.uint8))
    p = predict("llama-debug", mode="bsdp", workers=3, mask=mask, device="cuda", **LLAMA)
    assert p["process_groups"] == 3 and p["communicator_count"] == 3
    assert p["communicators"] == 3 * NCCL_COMMUNICATOR_BYTES
    one = predict("llama-debug", mode="bsdp", workers=1, active=1.0, device="cuda", **LLAMA)
    assert one["communicator_count"] == 0 and one["process_groups"] == 0  # one rank: no process group


def test_bad_communicator_settings_are_refused_naming_them(monkeypatch):
    with pytest.raises(ConfigError, match="device 'tpu'"):
        predict("llama-debug", mode="ddp", workers=2, device="tpu")
    monkeypatch.setenv("SDP_NCCL_COMMUNICATOR_BYTES", "lots")
    with pytest.raises(ConfigError, match="SDP_NCCL_COMMUNICATOR_BYTES: memory size 'lots'"):
        predict("llama-debug", mode="ddp", workers=2, device="cuda")
    monkeypatch.setenv("SDP_NCCL_COMMUNICATOR_BYTES", "0")  # e.g. with NCCL_COMM_SPLIT_SHARE_RESOURCES=1
    assert predict("llama-debug", mode="ddp", workers=2, device="cuda")["communicators"] == 0


def test_cli_shows_process_groups_and_communicator_memory_on_cuda(capsys, monkeypatch):
    monkeypatch.setenv("SDP_NCCL_COMMUNICATOR_BYTES", "1GiB")
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "0")
    assert main(["plan", "--model", "llama-debug", "--workers", "4", "--memory-per-device", "2GiB", "--device", "cuda",
                 "--batch-size", "2", "--seq-len", "16", "--active", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "groups" in lines[1].split() and "comms" in lines[1].split()
    ddp = next(line for line in lines if line.startswith("DDP ")).split()
    bsdp = next(line for line in lines if line.startswith("B-SDP ")).split()
    assert ddp[2] == "0" and ddp[-1] == "yes" and bsdp[2] == "4" and bsdp[-1] == "no"  # 3 x 1 GiB > 2 GiB
    assert any("at 1.0 GiB each" in line for line in lines)


def test_cli_shows_what_no_mask_removes_and_its_share_of_the_peak(capsys):
    argv = ["plan", "--model", "llama-debug", "--workers", "4", "--memory-per-device", "2GiB", "--batch-size", "2",
            "--seq-len", "16", "--active", "0.5", "--fsdp"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "no mask" in lines[1]
    row = predict("llama-debug", mode="bsdp", fsdp=True, workers=4, active=0.5, batch_size=2, seq_len=16)
    both = next(line for line in lines if line.startswith("B-SDP+FSDP "))
    assert f"({row['unmaskable'] / row['total']:.0%})" in both
    assert any(line.startswith("no mask: ") for line in lines)


@pytest.mark.parametrize(("mode", "extra"), [("fsdp", {}), ("bsdp", {"fsdp": True, "active": 0.5})])
def test_with_embedding_and_head_units_no_reduce_scatter_holds_every_shared_gradient(mode, extra):
    """llama-134m, K = 2, 1 x 1024, AC (BENCHMARKS.md, "Memory at scale: embedding and head units"): the
    head's unit reduce-scatters its gradients when its backward ends, the embedding's at the end of
    backward, each 2 g + 2 g / K for g bytes of gradients, instead of the root's for both at once (the
    peak before, measured 1,662.7 MB in both systems, 534 KB below the plan's formula)."""
    p = predict("llama-134m", mode=mode, workers=2, batch_size=1, seq_len=1024, ac=True, **extra)
    config = get_model_config("llama-134m")
    n, d, v = 1024, config.dim, config.vocab_size
    constant = 2 * n * config.head_dim * 4 + 2 * n * 8
    both = 4 * (2 * v * d + d)  # embedding, head, final norm: the root's reduce-scatter before
    assert p["total"] < sum(p["persistent"].values()) + 2 * both + 2 * (both // 2) + constant
    head = 4 * (v * d + d)
    below = 4 * (n * d + config.n_layers // (2 if mode == "bsdp" else 1) * n * d)  # stem, block inputs (AC)
    assert p["peak_at"] == "reduce-scatter of the head"
    block = 4 * _numel_of(config, "layers.0.") if mode == "fsdp" else 0  # FSDP's prefetch of the last block
    assert p["total"] == sum(p["persistent"].values()) + below + constant + 2 * head + 2 * (head // 2) + block


def _numel_of(config, prefix: str) -> int:
    return sum(int(np.prod(s)) for n, s in block_map(config).shapes.items() if n.startswith(prefix))
