"""SubnetworkDataParallel on real gloo ranks, for models the project did not write.

One torchrun launch (2 ranks) trains, through the public API only, (a) a small custom module
defined here, (b) a Hugging Face ``LlamaForCausalLM`` from a tiny ``LlamaConfig`` and (c) a
Swin-style model defined here (shifted window attention, patch merging; its blocks span two
stages), each with B-SDP and N-SDP, plus a complete mask next to torch DDP; the custom module also
with backward masking and with activation checkpointing plus FSDP2. The ranks save what they hold. The tests
compare it with a single-process reference built only from the mask: the full model, every
worker's part removed by forward hooks (a skipped block; zeroed hidden neurons), each gradient
entry averaged over the workers that hold it, and the same AdamW and LR schedule.

Run by hand: ``python -m torch.distributed.run --standalone --nproc-per-node 2 THIS_FILE OUTDIR``.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from masklab import Mask

K, STEPS, GROUPS = 2, 3, 2
BLOCK_MASK = np.array([[1, 1, 0, 1], [0, 1, 1, 1]])  # holder sets {0}, {0,1}, {1}, {0,1}
NEURON_MASK = np.array([[1, 1, 1, 0, 0, 1, 1, 1],  # worker 0 holds blocks 0 and 3 whole
                        [0, 1, 1, 1, 1, 0, 1, 0]])  # (block, group) columns; single holders too
MASKS = {"block": BLOCK_MASK, "neuron": NEURON_MASK, "backward": BLOCK_MASK}
KINDS = ("custom", "llama", "swin")
BLOCKS = {"custom": "layers.*", "llama": "model.layers.*", "swin": "stages.*.blocks.*"}
"""The blocks of each model; Swin's span two stages, so it is named by a pattern."""
OPTIONS = {"neuron": {"level": "neuron"}, "backward": {"masking": "backward"},
           "block_fsdp": {"fsdp": True, "activation_checkpointing": True}}
"""Keyword arguments of each run besides the mask; its mask is MASKS[run name up to "_"]."""


# -- the models and data (shared by the ranks and the reference) ---------------------------------
class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.mlp(self.norm(x))


class TinyNet(nn.Module):
    """A user's model: input projection, a ModuleList of residual MLP blocks, a head."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(6, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return self.head(h)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside non-overlapping w x w windows, optionally cyclically shifted."""

    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        # no qkv bias: the key bias's true gradient is 0, and AdamW would turn its rounding noise
        # into full-size steps of either sign, in the reference and the run alike
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.heads, self.window, self.shift = heads, window, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, W, C)
        b, h, w_, c = x.shape
        w = self.window
        x = torch.roll(x, (-self.shift, -self.shift), (1, 2))
        windows = x.view(b, h // w, w, w_ // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)
        q, k, v = self.qkv(windows).view(-1, w * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, w * w, c)
        out = self.proj(out).view(b, h // w, w_ // w, w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w_, c)
        return torch.roll(out, (self.shift, self.shift), (1, 2))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, shift: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), WindowAttention(dim, 2, 2, shift)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stage(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SwinBlock(dim, 0), SwinBlock(dim, 1)])


class PatchMerging(nn.Module):
    """2 x 2 neighbouring tokens -> one token of twice the width (halves H and W)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.reduce = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduce(self.norm(x))


class TinySwin(nn.Module):
    """Swin-style: patch embedding, two stages of (shifted) window-attention blocks, patch merging."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 16, 2, stride=2)
        self.stages = nn.ModuleList([Stage(16), Stage(32)])
        self.merge = PatchMerging(16)
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 8, 8) -> logits (B, 3)
        h = self.patch(x).permute(0, 2, 3, 1)
        for i, stage in enumerate(self.stages):
            for block in stage.blocks:
                h = block(h)
            if i == 0:
                h = self.merge(h)
        return self.head(self.norm(h).mean(dim=(1, 2)))


class BatchNormBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.BatchNorm1d(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class BatchNormNet(nn.Module):
    """Residual blocks with BatchNorm: running statistics that each holder updates from its own batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(BatchNormBlock(8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       tie_word_embeddings=False)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "custom":
        return TinyNet()
    if kind == "swin":
        return TinySwin()
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(llama_config())


def batch(kind: str, step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "custom":
        return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)
    if kind == "swin":
        return torch.randn(size, 1, 8, 8, generator=g), torch.randint(0, 3, (size,), generator=g)
    ids = torch.randint(0, 32, (size // 2, 12), generator=g)
    return ids, ids


def loss_of(kind: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if kind != "llama":
        return F.cross_entropy(model(inputs), targets)
    return model(input_ids=inputs, labels=targets).loss


def optimizer_for(params) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def val_loss(kind: str, model: nn.Module) -> float:
    with torch.no_grad():
        return loss_of(kind, model, *batch(kind, 999, 0, size=16)).item()


# -- the single-process reference ---------------------------------------------------------------
def mlp_inputs(kind: str, block: nn.Module) -> list[nn.Linear]:
    return [block.mlp[0]] if kind != "llama" else [block.mlp.gate_proj, block.mlp.up_proj]


def mlp_params(kind: str, block_name: str) -> dict[str, int]:
    """Full-model tensor -> its hidden-neuron dimension, for one block's MLP."""
    if kind != "llama":
        return {f"{block_name}.mlp.0.weight": 0, f"{block_name}.mlp.0.bias": 0, f"{block_name}.mlp.2.weight": 1}
    return {f"{block_name}.mlp.{p}.weight": d for p, d in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))}


def blocks_of(kind: str, model: nn.Module) -> list[tuple[str, nn.Module]]:
    if kind == "swin":
        return [(f"stages.{i}.blocks.{j}", b) for i, s in enumerate(model.stages) for j, b in enumerate(s.blocks)]
    layers = model.layers if kind == "custom" else model.model.layers
    prefix = "layers" if kind == "custom" else "model.layers"
    return [(f"{prefix}.{i}", b) for i, b in enumerate(layers)]


def block_names(kind: str) -> list[str]:
    with torch.device("meta"):
        return [name for name, _ in blocks_of(kind, make_model(kind))]


def neuron_holding(matrix: np.ndarray, j: int, hidden: int) -> np.ndarray:
    """(K, hidden) 0/1: which worker holds each hidden neuron of block j (contiguous groups)."""
    groups = np.array_split(np.arange(hidden), GROUPS)
    held = np.zeros((K, hidden))
    for g, idx in enumerate(groups):
        held[:, idx] = matrix[:, j * GROUPS + g][:, None]
    return held


def masked_grads(kind: str, level: str, model: nn.Module, rank: int, step: int) -> dict[str, torch.Tensor]:
    """Worker `rank`'s gradient: the full model with its non-held parts removed by forward hooks."""
    matrix, hooks = MASKS[level], []
    for j, (_, block) in enumerate(blocks_of(kind, model)):
        if level == "block" and not matrix[rank, j]:
            hooks.append(block.register_forward_hook(lambda m, args, out: args[0]))
        if level == "neuron":
            keep = torch.tensor(neuron_holding(matrix, j, mlp_inputs(kind, block)[0].out_features)[rank],
                                dtype=torch.float32)
            for proj in mlp_inputs(kind, block):
                hooks.append(proj.register_forward_hook(lambda m, args, out, keep=keep: out * keep))
    model.zero_grad(set_to_none=False)
    loss_of(kind, model, *batch(kind, step, rank)).backward()
    for h in hooks:
        h.remove()
    if level == "backward":  # the full forward pass; gradients of held blocks only
        for j, (name, block) in enumerate(blocks_of(kind, model)):
            if not matrix[rank, j]:
                for p in block.parameters():
                    p.grad.zero_()
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def coverage(kind: str, level: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Full-model tensor -> number of workers holding each entry."""
    matrix = MASKS["neuron" if level == "neuron" else "block"]
    cover = {n: torch.full_like(p, float(K)) for n, p in model.named_parameters()}
    for j, (name, block) in enumerate(blocks_of(kind, model)):
        if level != "neuron":
            for n in cover:
                if n.startswith(name + "."):
                    cover[n].fill_(float(matrix[:, j].sum()))
            continue
        held = neuron_holding(matrix, j, mlp_inputs(kind, block)[0].out_features).sum(axis=0)
        for n, dim in mlp_params(kind, name).items():
            shape = [1, 1]
            shape[dim] = -1
            cover[n] = torch.tensor(held, dtype=torch.float32).view(shape[:cover[n].dim()]).expand_as(cover[n]).clone()
    return cover


def reference_run(kind: str, level: str) -> dict:
    """STEPS steps of SDP simulated in one process: holder averages of the masked workers' gradients."""
    model = make_model(kind)
    opt, schedule = optimizer_for(model.parameters())
    cover = coverage(kind, level, model)
    params = dict(model.named_parameters())
    result: dict = {}
    for step in range(STEPS):
        grads = [masked_grads(kind, level, model, k, step) for k in range(K)]
        average = {n: sum(g[n] for g in grads) / cover[n] for n in params}
        if step == 0:
            result["grads"] = average
        for n, p in params.items():
            p.grad = average[n].clone()
        opt.step()
        schedule.step()
    result["state"] = {n: t.clone() for n, t in model.state_dict().items()}
    result["val"] = val_loss(kind, model)
    return result


# -- rank side: what every worker runs under torchrun ---------------------------------------------
def train_ranks(kind: str, level: str | None, out: Path, rank: int) -> None:
    """Train STEPS steps (level None: torch DDP; "complete": B-SDP with an all-ones mask); save."""
    from sdp_train import SubnetworkDataParallel

    model = make_model(kind)
    tag = f"{kind}_{level or 'ddp'}"
    if level is None:
        wrapped, module = nn.parallel.DistributedDataParallel(model), model
    else:
        matrix = np.ones((K, 4), dtype=int) if level == "complete" else MASKS[level.split("_")[0]]
        wrapped = SubnetworkDataParallel(model, mask=Mask(matrix), blocks=BLOCKS[kind], neuron_groups=GROUPS,
                                         **OPTIONS.get(level, {}))
        module = wrapped.module
    opt, schedule = optimizer_for(wrapped.parameters())
    if level == "backward":
        wrapped.register_optimizer(opt)
    saved: dict = {"lr": []}
    for step in range(STEPS):
        loss_of(kind, wrapped, *batch(kind, step, rank)).backward()
        if step == 0 and level != "block_fsdp":
            saved["grads"] = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        opt.step()
        schedule.step()
        opt.zero_grad()
        saved["lr"].append(opt.param_groups[0]["lr"])
    names = {p: n for n, p in module.named_parameters()}
    if level != "block_fsdp":  # FSDP: sharded tensors, compared through the assembled full model
        saved["state"] = {n: t.clone() for n, t in module.state_dict().items()}
        saved["optim"] = {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    if level is not None:
        saved["index"] = {n: (s.dim, s.index, s.full_size) for n, s in wrapped.local_index.items()}
        saved["full"] = wrapped.full_state_dict()
        saved["full_rank0"] = wrapped.full_state_dict(rank0_only=True)
        wrapped.save_full(out / (f"{tag}.safetensors" if kind == "custom" else tag))
    torch.save(saved, out / f"{tag}_rank{rank}.pt")


def accumulation_and_clipping_ranks(out: Path, rank: int) -> None:
    """no_sync over 3 micro-batches vs one concatenated batch; torch's clipping vs the library's."""
    from sdp_train import SubnetworkDataParallel

    micro = [batch("custom", s, rank) for s in range(3)]
    accumulated = SubnetworkDataParallel(make_model("custom"), mask=Mask(BLOCK_MASK))
    for i, (x, y) in enumerate(micro):
        with accumulated.no_sync() if i < 2 else contextlib.nullcontext():
            (loss_of("custom", accumulated, x, y) / 3).backward()
    whole = SubnetworkDataParallel(make_model("custom"), mask=Mask(BLOCK_MASK))
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    loss_of("custom", whole, x, y).backward()
    saved = {"accumulated": _grads(accumulated), "whole": _grads(whole), "bytes": (accumulated.comm_bytes,
                                                                                   whole.comm_bytes)}
    for how in ("torch", "sdp"):
        model = SubnetworkDataParallel(make_model("custom"), mask=Mask(BLOCK_MASK))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        loss_of("custom", model, *batch("custom", 0, rank)).backward()
        grads = _grads(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2) if how == "torch"
                    else model.clip_grad_norm_(1e-2))
        opt.step()
        state = {n: t.clone() for n, t in model.module.state_dict().items()}
        saved[how] = {"norm": norm, "grads": grads, "state": state,
                      "warnings": [(str(w.message), Path(w.filename).name) for w in caught]}
    bf16 = SubnetworkDataParallel(make_model("custom"), mask=Mask(BLOCK_MASK), comm_dtype=torch.bfloat16,
                                  autocast_dtype=torch.bfloat16)
    loss_of("custom", bf16, *batch("custom", 0, rank)).backward()
    saved["bf16"] = {"grads": _grads(bf16), "bytes": bf16.comm_bytes}
    torch.manual_seed(0)
    bn = SubnetworkDataParallel(BatchNormNet(), mask=Mask(BLOCK_MASK))
    loss_of("custom", bn, *batch("custom", 0, rank)).backward()
    saved["batchnorm"] = {n: t.clone() for n, t in bn.module.state_dict().items() if "running" in n}
    torch.save(saved, out / f"accumulation_rank{rank}.pt")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    rank = dist.get_rank()
    accumulation_and_clipping_ranks(out, rank)
    for kind in KINDS:
        extra = ("backward", "block_fsdp") if kind == "custom" else ()
        for level in ("block", "neuron", "complete", None, *extra):
            train_ranks(kind, level, out, rank)


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])


# -- the tests -------------------------------------------------------------------------------------
pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_api_training")


def _load(out: Path, tag: str) -> list[dict]:
    return [torch.load(out / f"{tag}_rank{r}.pt", weights_only=False) for r in range(K)]


def _full_view(local: torch.Tensor, index: tuple, full: torch.Tensor) -> torch.Tensor:
    dim, idx, _ = index
    return full if dim is None else full.index_select(dim, torch.tensor(idx, dtype=torch.int64))


def _common(a: dict, b: dict, name: str, ta: torch.Tensor, tb: torch.Tensor):
    """The entries of `name` both ranks hold, as two tensors in the same (full-model) order."""
    (da, ia, _), (db, ib, _) = a["index"][name], b["index"][name]
    if da is None and db is None:
        return ta, tb
    dim = da if da is not None else db
    pos_a = range(ta.shape[dim]) if da is None else ia
    pos_b = range(tb.shape[dim]) if db is None else ib
    shared = sorted(set(pos_a) & set(pos_b))
    where_a, where_b = {f: i for i, f in enumerate(pos_a)}, {f: i for i, f in enumerate(pos_b)}
    pick = lambda t, w: t.index_select(dim, torch.tensor([w[f] for f in shared], dtype=torch.int64))  # noqa: E731
    return pick(ta, where_a), pick(tb, where_b)


RUNS = [("custom", "block"), ("custom", "neuron"), ("custom", "backward"), ("llama", "block"), ("llama", "neuron"),
        ("swin", "block"), ("swin", "neuron")]


@pytest.mark.parametrize(("kind", "level"), RUNS)
def test_holders_stay_bit_identical_including_optimizer_state(ranks_out, kind, level):
    a, b = _load(ranks_out, f"{kind}_{level}")
    both = sorted(set(a["state"]) & set(b["state"]))
    for name in both:
        x, y = _common(a, b, name, a["state"][name], b["state"][name])
        assert torch.equal(x, y), name
        if name in a["optim"] and name in b["optim"]:
            for key in ("exp_avg", "exp_avg_sq"):
                x, y = _common(a, b, name, a["optim"][name][key], b["optim"][name][key])
                assert torch.equal(x, y), (name, key)


@pytest.mark.parametrize(("kind", "level"), RUNS)
def test_averaged_gradient_is_the_holder_average_and_training_matches_the_reference(ranks_out, kind, level):
    ranks = _load(ranks_out, f"{kind}_{level}")
    ref = reference_run(kind, level)
    for r, saved in enumerate(ranks):
        dropped = [] if level == "neuron" else [f"{n}." for j, n in enumerate(block_names(kind))
                                                if not BLOCK_MASK[r, j]]
        assert set(saved["grads"]) == {n for n in saved["index"] if n in ref["grads"]
                                       and not any(n.startswith(d) for d in dropped)}
        for name, grad in saved["grads"].items():
            expected = _full_view(grad, saved["index"][name], ref["grads"][name])
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=f"rank {r} {name}")
        assert saved["lr"] == pytest.approx([1.0e-2 / (1 + s) for s in range(1, STEPS + 1)])  # the user's schedule
    for name, value in ranks[0]["full"].items():
        torch.testing.assert_close(value, ref["state"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert ranks[0]["full_rank0"].keys() == ranks[0]["full"].keys() and ranks[1]["full_rank0"] == {}


def test_checkpointed_blocks_sharded_by_fsdp_among_holders_train_as_the_reference(ranks_out):
    ranks = _load(ranks_out, "custom_block_fsdp")
    ref = reference_run("custom", "block")
    for name, value in ranks[0]["full"].items():
        torch.testing.assert_close(value, ref["state"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert ranks[1]["full"].keys() == ranks[0]["full"].keys()


@pytest.mark.parametrize("kind", KINDS)
def test_a_complete_mask_trains_as_ddp_does(ranks_out, kind):
    sdp, ddp = _load(ranks_out, f"{kind}_complete")[0], _load(ranks_out, f"{kind}_ddp")[0]
    assert sdp["full"].keys() == ddp["state"].keys()
    for name, value in sdp["full"].items():
        torch.testing.assert_close(value, ddp["state"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_exported_custom_model_reloads_with_every_key_and_the_reference_validation_loss(ranks_out, level):
    from safetensors.torch import load_file

    model = TinyNet()
    assert not model.load_state_dict(load_file(ranks_out / f"custom_{level}.safetensors"), strict=True).missing_keys
    assert val_loss("custom", model) == pytest.approx(reference_run("custom", level)["val"], rel=1e-5)


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_exported_llama_loads_with_from_pretrained_and_the_reference_validation_loss(ranks_out, level):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(ranks_out / f"llama_{level}", output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert val_loss("llama", model) == pytest.approx(reference_run("llama", level)["val"], rel=1e-5)


def test_no_sync_accumulation_equals_one_step_on_the_concatenated_batch(ranks_out):
    for saved in _load(ranks_out, "accumulation"):
        assert saved["accumulated"].keys() == saved["whole"].keys()
        for name, grad in saved["accumulated"].items():
            torch.testing.assert_close(grad, saved["whole"][name], rtol=1e-5, atol=1e-7, msg=name)
        assert saved["bytes"][0] == saved["bytes"][1]  # one sync, not three


def test_library_clipping_keeps_holders_identical_where_torch_clipping_does_not(ranks_out):
    a, b = _load(ranks_out, "accumulation")
    shared = ["embed.weight", "head.weight", "layers.1.mlp.0.weight"]  # held by both workers
    assert any(not torch.equal(a["torch"]["state"][n], b["torch"]["state"][n]) for n in shared)
    assert a["torch"]["norm"] != b["torch"]["norm"]
    for name in set(a["sdp"]["state"]) & set(b["sdp"]["state"]):
        assert torch.equal(a["sdp"]["state"][name], b["sdp"]["state"][name]), name
    assert a["sdp"]["norm"] == b["sdp"]["norm"]
    # torch's clipping on an SDP model warns, naming the caller's file; the library's does not
    for saved in (a, b):
        [(message, where)] = saved["torch"]["warnings"]
        assert message.startswith("torch.nn.utils.clip_grad_norm_ on the parameters of a SubnetworkDataParallel")
        assert "model.clip_grad_norm_(max_norm)" in message and where == "test_api_training.py"
        assert saved["sdp"]["warnings"] == []


def test_bf16_buffers_halve_the_bytes_and_keep_fp32_gradients(ranks_out):
    for saved in _load(ranks_out, "accumulation"):
        assert saved["bf16"]["bytes"] * 2 == saved["bytes"][1]
        for name, grad in saved["bf16"]["grads"].items():
            fp32 = saved["sdp"]["grads"][name]
            assert grad.dtype == torch.float32
            assert (grad - fp32).norm() <= 0.03 * fp32.norm(), name  # bf16 keeps ~3 significant digits


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_model_has_no_tensor_of_its_dropped_blocks(ranks_out, kind):
    names = block_names(kind)
    for r, saved in enumerate(_load(ranks_out, f"{kind}_block")):
        held = {j for j in range(4) if any(n.startswith(f"{names[j]}.") for n in saved["state"])}
        assert held == set(np.flatnonzero(BLOCK_MASK[r]).tolist()), r


def test_holders_average_their_batchnorm_running_statistics(ranks_out):
    a, b = (saved["batchnorm"] for saved in _load(ranks_out, "accumulation"))
    for name in ("layers.1.norm.running_mean", "layers.3.norm.running_var"):  # blocks held by both workers
        assert torch.equal(a[name], b[name]), name
    assert "layers.2.norm.running_mean" not in a and "layers.0.norm.running_mean" not in b
