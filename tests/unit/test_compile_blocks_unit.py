"""Per-block torch.compile (`sdp_train.parallel.compile`): a LLaMA block is one graph, inductor's
blocks train as eager ones do with gradients ready block by block, and what does not compile is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdp_train import SubnetworkDataParallel
from sdp_train.errors import ConfigError
from sdp_train.models import build_model, get_model_config
from sdp_train.models.llama import rope_cos_sin
from sdp_train.models.subnet import build_worker_model, residual_blocks
from sdp_train.parallel.compile import compile_blocks
from sdp_train.trainer.config import TrainConfig

CONFIG = get_model_config("llama-debug", n_layers=2)


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_a_llama_block_is_one_graph_without_breaks(level):
    """Whole blocks and N-SDP's sliced ones: dynamo captures each block's forward as one graph."""
    row = [1, 1] if level == "block" else [1, 0, 1, 0, 1, 1, 0, 1] + [1, 0, 0, 0, 0, 0, 0, 1]  # 5 and 2 of 8 groups
    model = build_worker_model(CONFIG, np.array(row), level, seed=0, device=torch.device("cpu"))
    cos, sin = rope_cos_sin(16, CONFIG.head_dim, CONFIG.rope_theta, torch.device("cpu"))
    x = torch.randn(2, 16, CONFIG.dim)
    for _, block in residual_blocks(model):
        explained = torch._dynamo.explain(block)(x, cos, sin)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.slow
def test_inductor_blocks_equal_eager_and_give_gradients_block_by_block():
    """Three SGD steps of the same model, eager and with each block compiled by inductor: the same
    losses and parameters to float32 rounding; and every parameter of the last block gets its gradient
    (its post-accumulate-grad hook, where the sync engine launches) before any of the first block's."""
    torch.manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (3, 2, 17))
    losses, params, order = [], [], []
    for compiled in (False, True):
        model = build_model(CONFIG, seed=0, device=torch.device("cpu"))
        if compiled:
            compile_blocks(model, [n for n, _ in residual_blocks(model)], backend="inductor", fullgraph=True)
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for batch in tokens:
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(loss.detach())
        losses.append(torch.stack(run))
        params.append(dict(model.named_parameters()))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for name, p in params[0].items():
        torch.testing.assert_close(params[1][name], p, rtol=1e-4, atol=1e-5, msg=name)
    first_step = order[:len(params[1])]
    last_of_1 = max(i for i, n in enumerate(first_step) if n.startswith("layers.1."))
    first_of_0 = min(i for i, n in enumerate(first_step) if n.startswith("layers.0."))
    assert last_of_1 < first_of_0, first_step


@pytest.mark.parametrize("options, named", [
    ({"activation_checkpointing": True}, "activation_checkpointing=True"),
    ({"compile": "no-such-backend"}, "no-such-backend"),
])
def test_the_wrapper_refuses_what_does_not_compile(options, named):
    model = build_model(CONFIG, seed=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=named):
        SubnetworkDataParallel(model, active=1.0, blocks="layers.*", **{"compile": True, **options})


@pytest.mark.parametrize("options, named", [
    ({"mode": "fsdp"}, "mode 'fsdp'"),
    ({"mode": "bsdp", "fsdp": True, "active": 0.5}, "fsdp"),
    ({"mode": "bsdp", "active": 0.5, "activation_checkpointing": True}, "activation_checkpointing"),
    ({"mode": "bsdp", "active": 0.5, "schedule": "permute", "every": 2}, "schedule='permute'"),
    ({"mode": "ddp", "compile": "no-such-backend"}, "no-such-backend"),
])
def test_sdp_train_refuses_compile_with_what_it_does_not_compile(options, named):
    with pytest.raises(ConfigError, match=named):
        TrainConfig(**{"model": "llama-debug", "workers": 2, "compile": "inductor", **options})


@pytest.mark.parametrize("argv, backend", [([], None), (["--compile"], "inductor"),
                                           (["--compile", "aot_eager"], "aot_eager")])
def test_sdp_train_compile_flag_alone_means_inductor(argv, backend):
    from sdp_train.cli import build_parser
    from sdp_train.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--model", "llama-debug", "--mode", "ddp", *argv])
    assert config_from_args(args).compile == backend


def test_a_block_whose_forward_was_replaced_is_refused_naming_the_block_and_why():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].forward = lambda x: x  # as activation checkpointing, or another tool, wraps it
    with pytest.raises(ConfigError, match=r"block '1': its forward was replaced on the instance"):
        compile_blocks(model, ["0", "1"], backend="eager")
    assert model[0]._compiled_call_impl is None  # checked before any block compiles
