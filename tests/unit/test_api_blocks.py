"""Finding blocks and MLPs in models the project did not write, and cutting them (one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from masklab import Mask, Schedule
from sdp_train import MLPSpec, SubnetworkDataParallel, find_blocks
from sdp_train.errors import ConfigError
from sdp_train.parallel.discovery import find_mlp
from sdp_train.parallel.masking import PassThrough, describe, drop_blocks, slice_neurons
from sdp_train.parallel.parts import resolve_mask

transformers = pytest.importorskip("transformers")


class Residual(nn.Module):
    def __init__(self, width: int = 8, tuple_out: bool = False) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 3 * width), nn.ReLU(), nn.Linear(3 * width, width))
        self.tuple_out = tuple_out

    def forward(self, x, *, gain: float = 1.0):
        y = x + gain * self.mlp(x)
        return (y, y.mean()) if self.tuple_out else y


class Net(nn.Module):
    def __init__(self, depth: int = 4, tuple_out: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(5, 8)
        self.trunk = nn.ModuleList(Residual(tuple_out=tuple_out) for _ in range(depth))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.stem(x)
        for block in self.trunk:
            out = block(h, gain=0.5)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(h)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32))


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32,
                                                                n_positions=32, bos_token_id=0, eos_token_id=0))


def vit():
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32, image_size=8,
        patch_size=4, num_channels=1, num_labels=3))


HF = {"llama": (llama, lambda: {"input_ids": torch.randint(0, 32, (2, 7))}),
      "gpt2": (gpt2, lambda: {"input_ids": torch.randint(0, 32, (2, 7))}),
      "vit": (vit, lambda: {"pixel_values": torch.randn(2, 1, 8, 8)})}
HF_BLOCKS = {"llama": "model.layers", "gpt2": "transformer.h", "vit": "vit.layers"}


def logits(model, inputs):
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("kind", sorted(HF))
def test_discovery_finds_the_decoder_layers_of_hugging_face_layouts(kind):
    model = HF[kind][0]()
    n = len(model.get_submodule(HF_BLOCKS[kind]))
    assert find_blocks(model) == [f"{HF_BLOCKS[kind]}.{i}" for i in range(n)]


def test_blocks_by_pattern_by_names_and_by_submodules_agree():
    model = Net()
    names = [f"trunk.{i}" for i in range(4)]
    assert find_blocks(model) == names
    assert find_blocks(model, "trunk.*") == names
    assert find_blocks(model, list(reversed(names))) == names  # forward order, whatever the order given
    assert find_blocks(model, [model.trunk[2], model.trunk[0]]) == ["trunk.0", "trunk.2"]


def test_a_pattern_that_matches_nothing_names_the_block_lists_the_model_has():
    with pytest.raises(ConfigError, match=r"'layers\.\*' matches no submodule of Net.*trunk\.\* \(4 x Residual\)"):
        find_blocks(Net(), "layers.*")
    with pytest.raises(ConfigError, match="'trunk.9' is not a submodule"):
        find_blocks(Net(), ["trunk.0", "trunk.9"])
    with pytest.raises(ConfigError, match="must not nest"):
        find_blocks(Net(), ["trunk.0", "trunk.0.mlp", "trunk.1"])
    with pytest.raises(ConfigError, match="no ModuleList"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_two_equally_large_block_lists_are_ambiguous():
    model = nn.Module()
    model.a, model.b = Net().trunk, Net().trunk
    with pytest.raises(ConfigError, match=r"several equally large block lists \['a', 'b'\]"):
        find_blocks(model)


@pytest.mark.parametrize(("kind", "expected"), [("llama", (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")),
                                                ("gpt2", (("mlp.c_fc",), "mlp.c_proj")),
                                                ("vit", (("mlp.fc1",), "mlp.fc2"))])
def test_mlp_discovery_finds_the_hidden_projections(kind, expected):
    model = HF[kind][0]()
    block = model.get_submodule(f"{HF_BLOCKS[kind]}.0")
    assert find_mlp(block, "b") == MLPSpec(*expected)


def test_a_missing_mlp_is_named_with_the_projections_the_block_has():
    block = nn.Module()
    block.proj_a, block.proj_b = nn.Linear(2, 4), nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"found no MLP in block 'x'.*\['proj_a', 'proj_b'\].*MLPSpec"):
        find_mlp(block, "x")
    assert find_mlp(block, "x", MLPSpec("proj_a", "proj_b")) == MLPSpec(("proj_a",), "proj_b")
    with pytest.raises(ConfigError, match="has no submodule 'up'"):
        find_mlp(block, "x", MLPSpec("up", "proj_b"))


def _skip_hooks(model, names):
    def skip(module, args, kwargs, out):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *[None] * (len(out) - 1)) if isinstance(out, tuple) else hidden
    return [model.get_submodule(n).register_forward_hook(skip, with_kwargs=True) for n in names]


@pytest.mark.parametrize("kind", sorted(HF))
def test_dropped_hugging_face_layers_pass_hidden_states_through_with_their_keyword_arguments(kind):
    make, inputs_of = HF[kind]
    torch.manual_seed(1)
    inputs = inputs_of()
    reference = make()
    names = find_blocks(reference)
    row = np.array([1, 0] + [1] * (len(names) - 2))
    for h in _skip_hooks(reference, [n for n, keep in zip(names, row) if not keep]):
        pass
    expected = logits(reference, inputs)
    model = make()
    assert drop_blocks(model, names, row) == [names[1]]
    assert isinstance(model.get_submodule(names[1]), PassThrough)
    assert not any(n.startswith(names[1] + ".") for n in model.state_dict())
    torch.testing.assert_close(logits(model, inputs), expected, rtol=0, atol=0)


def test_a_dropped_block_returning_a_tuple_returns_the_hidden_states_first():
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    model, reference = Net(tuple_out=True), Net(tuple_out=True)
    reference.load_state_dict(model.state_dict())
    _skip_hooks(reference, ["trunk.0", "trunk.3"])
    drop_blocks(model, ["trunk.0", "trunk.1", "trunk.2", "trunk.3"], np.array([0, 1, 1, 0]))
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert model.trunk[0](x, gain=2.0)[1] is None


def _zero_hidden_hooks(model, blocks, spec: MLPSpec, keep: dict[str, torch.Tensor]):
    for b in blocks:
        for rel in spec.inputs:
            model.get_submodule(f"{b}.{rel}").register_forward_hook(lambda m, a, out, k=keep[b]: out * k)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "custom"])
def test_sliced_mlps_compute_what_the_full_model_computes_with_the_other_neurons_zeroed(kind):
    torch.manual_seed(2)
    if kind == "custom":
        make, inputs = Net, {"x": torch.randn(4, 5)}
    else:
        make, inputs = HF[kind][0], HF[kind][1]()
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    blocks = find_blocks(model)
    layout = describe(model, blocks, "neuron", neuron_groups=4)
    rng = np.random.default_rng(0)
    row = rng.integers(0, 2, size=len(layout.columns))
    row.reshape(len(blocks), 4)[:, 0] = 1  # every block keeps a group
    held = layout.held(row)
    keep = {}
    for j, b in enumerate(blocks):
        mask = torch.zeros(layout.hidden[b])
        mask[list(layout.group_index(b, np.flatnonzero(row.reshape(len(blocks), 4)[j])))] = 1
        keep[b] = mask
    _zero_hidden_hooks(reference, blocks, layout.mlps[blocks[0]], keep)
    slice_neurons(model, layout, row)
    for name, tensor in model.state_dict().items():
        spec = held[name]
        assert spec.full_shape(tensor.shape) == layout.tensors[name][0], name
        assert spec.is_whole or tensor.shape[spec.dim] == len(spec.index), name
    if kind == "custom":
        torch.testing.assert_close(model(**inputs), reference(**inputs), rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(logits(model, inputs), logits(reference, inputs), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(1, 4), st.data())
def test_neuron_holdings_cover_each_neuron_as_often_as_its_column(workers, groups, data):
    model = Net(depth=2)
    layout = describe(model, ["trunk.0", "trunk.1"], "neuron", neuron_groups=groups)
    matrix = np.array(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=2 * groups, max_size=2 * groups),
                                         min_size=workers, max_size=workers)))
    matrix.reshape(workers, 2, groups)[:, :, 0] = 1
    counts = np.zeros(24 * 2)
    for row in matrix:
        for j, b in enumerate(("trunk.0", "trunk.1")):
            spec = layout.held(row)[f"{b}.mlp.0.weight"]
            idx = range(24) if spec.is_whole else spec.index
            counts[[j * 24 + i for i in idx]] += 1
    expected = [matrix[:, j * groups + g].sum() for j in range(2) for g in range(groups)
                for _ in layout.group_index("trunk.0", [g])]
    np.testing.assert_array_equal(counts, expected)


def test_a_meta_device_model_materialises_only_what_the_worker_holds():
    with torch.device("meta"):
        model = Net()
    drop_blocks(model, find_blocks(model), np.array([1, 0, 0, 1]))
    model.to_empty(device="cpu")
    assert sorted({n.split(".")[1] for n in model.state_dict() if n.startswith("trunk.")}) == ["0", "3"]
    assert all(not p.is_meta for p in model.parameters())


def test_a_single_process_wrapper_loads_a_full_state_and_exports_it_back():
    full = Net().state_dict()
    with torch.device("meta"):
        model = Net()
    sdp = SubnetworkDataParallel(model, mask=Mask([[1, 1, 1, 1]]), init_state=full)
    exported = sdp.full_state_dict()
    assert exported.keys() == full.keys()
    assert all(torch.equal(exported[n], full[n]) for n in full)


def test_a_wrapper_nobody_references_is_freed_though_its_module_lives_on():
    """Its gradient and optimizer hooks live in C++ on the module's parameters and the optimizer:
    held strongly, they kept the wrapper (and on a real run its process groups, whose threads then
    aborted the process at exit) alive for as long as the model. DDP is freed when dropped; so is this."""
    import gc
    import weakref

    net = Net()
    sdp = SubnetworkDataParallel(net, active=1.0, masking="backward")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sdp.register_optimizer(optimizer)
    wrapper = weakref.ref(sdp)
    del sdp
    gc.collect()
    assert wrapper() is None
    net(torch.randn(2, 5)).sum().backward()  # the orphaned hooks do nothing
    optimizer.step()


def test_user_errors_name_the_bad_value():
    with pytest.raises(ConfigError, match="exactly one of mask= and active="):
        SubnetworkDataParallel(Net())
    with pytest.raises(ConfigError, match="the mask has 3 columns but the model has 4"):
        SubnetworkDataParallel(Net(), mask=Mask([[1, 1, 1]]))
    with pytest.raises(ConfigError, match="level must be 'block' or 'neuron', got 'neurons'"):
        SubnetworkDataParallel(Net(), active=1.0, level="neurons")
    with pytest.raises(ConfigError, match="backward masking works at level 'block' only"):
        SubnetworkDataParallel(Net(), active=1.0, level="neuron", masking="backward")
    with pytest.raises(ConfigError, match="meta device: pass init_state="):
        with torch.device("meta"):
            model = Net()
        SubnetworkDataParallel(model, active=1.0)
    sdp = SubnetworkDataParallel(Net(), active=1.0)
    with pytest.raises(ConfigError, match="after a backward"):
        sdp.clip_grad_norm_(1.0)
    scheduled = Mask([[1, 1, 1, 1]], schedule=Schedule("permute", 2))
    with pytest.raises(ConfigError, match="schedules without fsdp only"):
        SubnetworkDataParallel(Net(), mask=scheduled, fsdp=True)
    sdp = SubnetworkDataParallel(Net(), mask=scheduled)  # B-SDP trains it: the optimizer must be registered
    with pytest.raises(ConfigError, match="call model.register_optimizer"):
        sdp(torch.randn(3, 5))
    for bad in ({"steps": 2, "mask_step": 3}, {"steps": 2, "mask_step": -1}, {"steps": 2, "mask_step": True}):
        with pytest.raises(ConfigError, match=r"expected \{'steps': n\} .*'mask_step': m with 0 <= m <= n"):
            sdp.load_schedule_state(bad)
    local = SubnetworkDataParallel(Net(), active=1.0, local_steps=2)  # static: no round to be in but steps'
    with pytest.raises(ConfigError, match=r"expected \{'steps': n\} with an integer n >= 0$"):
        local.load_schedule_state({"steps": 2, "mask_step": 1})


def test_active_designs_a_neuron_mask_in_which_every_worker_keeps_neurons_of_every_block():
    layout = describe(Net(), find_blocks(Net()), "neuron", neuron_groups=3)
    mask = resolve_mask(None, 0.5, 4, layout, seed=0)
    assert mask.matrix.shape == (4, 12)
    assert (mask.matrix.reshape(4, 4, 3).sum(axis=2) >= 1).all()
    assert mask.block_names[:2] == ("trunk.0.g0", "trunk.0.g1")
    broken = mask.matrix.copy()
    broken[2, 3:6] = 0
    broken[[0, 1], 3:6] = 1
    with pytest.raises(ConfigError, match=r"mask row 2 \(worker 2\): .*no neuron group of block 1 \('trunk.1'\)"):
        resolve_mask(Mask(broken), None, 4, layout, seed=0)


def test_clipping_refuses_a_gradient_that_no_sync_left_unaveraged():
    torch.manual_seed(0)
    sdp = SubnetworkDataParallel(Net(), active=1.0)
    x = torch.randn(4, 5)
    sdp(x).sum().backward()  # an averaged gradient, then a new accumulation starts
    sdp.zero_grad()
    with sdp.no_sync():
        sdp(x).sum().backward()
    with pytest.raises(ConfigError, match="outside no_sync"):
        sdp.clip_grad_norm_(1.0)
    sdp(x).sum().backward()
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in sdp.parameters()))
    torch.testing.assert_close(sdp.clip_grad_norm_(1e-3), total)
    assert torch.sqrt(sum(p.grad.pow(2).sum() for p in sdp.parameters())) == pytest.approx(1e-3, rel=1e-3)


def test_a_meta_device_model_with_non_persistent_buffers_needs_an_init_function():
    full = llama()
    with torch.device("meta"):
        model = llama()
    with pytest.raises(ConfigError, match=r"non-persistent buffers \['model.rotary_emb.inv_freq'"):
        SubnetworkDataParallel(model, active=1.0, init_state=full.state_dict())


def test_importing_the_package_stays_torch_free_until_the_api_is_used():
    import subprocess
    import sys

    code = "import sys, sdp_train; assert 'torch' not in sys.modules; assert 'SDP' in sdp_train.__all__"
    from tests.child_env import child_env

    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())
    from sdp_train import SDP
    assert SDP is SubnetworkDataParallel
