"""What Hugging Face's Trainer reads on a `SubnetworkDataParallel` model, in one process (issue 28).

The forward signature (Trainer keeps only the batch columns it names: with ``forward(*args,
**kwargs)`` it dropped them all, ``The batch received was empty``), the attributes it reads, and
`SDPTrainer`'s refusals. Training on 2 ranks: tests/distributed/test_hf_trainer.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from sdp_train import SubnetworkDataParallel
from sdp_train.errors import ConfigError

transformers = pytest.importorskip("transformers")


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, features: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            features = block(features)
        return scale * features


@pytest.mark.parametrize("build", [tiny_llama, Net], ids=["llama", "custom"])
def test_the_wrapper_forward_has_the_wrapped_model_signature(build):
    model = build()
    sdp = SubnetworkDataParallel(model, active=1.0)
    assert inspect.signature(sdp.forward) == inspect.signature(model.forward)
    assert inspect.signature(SubnetworkDataParallel.forward) != inspect.signature(model.forward)  # per instance


def test_the_wrapper_still_calls_its_own_forward_with_the_model_arguments():
    net = Net()
    sdp = SubnetworkDataParallel(net, active=1.0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(sdp(features=x, scale=2.0), net(x, scale=2.0))


def test_the_wrapper_reads_the_attributes_a_trainer_reads_from_the_model_and_no_method():
    llama = tiny_llama()
    sdp = SubnetworkDataParallel(llama, active=1.0)
    assert sdp.config is llama.config and sdp.generation_config is llama.generation_config
    assert sdp.main_input_name == "input_ids" and sdp._keys_to_ignore_on_save == llama._keys_to_ignore_on_save
    for name in ("save_pretrained", "generate", "vocab_size"):  # a worker's part alone: not the model's
        with pytest.raises(AttributeError, match=name):
            getattr(sdp, name)


def test_trainer_keeps_the_columns_the_model_takes_and_drops_the_others(tmp_path):
    pytest.importorskip("accelerate")
    sdp = SubnetworkDataParallel(tiny_llama(), active=1.0)
    ids = torch.arange(8)
    data = [{"input_ids": ids, "labels": ids, "path": "a.py"}] * 4
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                                          use_cpu=True)
    batch = next(iter(transformers.Trainer(model=sdp, args=args, train_dataset=data).get_train_dataloader()))
    assert sorted(batch) == ["input_ids", "labels"]


def test_sdp_trainer_refuses_what_would_act_on_one_worker_part(tmp_path):
    pytest.importorskip("accelerate")
    from sdp_train.integrations.hf import SDPTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ConfigError, match="got model=LlamaForCausalLM"):
        SDPTrainer(model=tiny_llama(), args=args)
    sdp = SubnetworkDataParallel(tiny_llama(), active=1.0)
    checkpointing = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                   activation_checkpointing=True)
    with pytest.raises(ConfigError, match=r"activation_checkpointing=True\) is not supported"):
        SDPTrainer(model=sdp, args=checkpointing)
    trainer = SDPTrainer(model=sdp, args=args)
    assert trainer.model is sdp.module and trainer.model_wrapped is sdp
    with pytest.raises(ConfigError, match="cannot resume from a Trainer checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path))


def test_no_doctest_example_of_the_hf_integration_runs_code_since_the_suite_does_not_collect_it():
    """conftest.py leaves sdp_train/integrations/hf.py out of the doctest collection (importing it costs every
    pytest-xdist worker transformers' Trainer): that is only sound while its examples are comments, which
    doctest does not count as examples."""
    import ast
    import doctest
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # `import conftest` may find another folder's conftest
    ignored = next(ast.literal_eval(node.value) for node in ast.parse((root / "conftest.py").read_text()).body
                   if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["collect_ignore"])
    assert "sdp_train/integrations/hf.py" in ignored
    tree = ast.parse((root / "sdp_train" / "integrations" / "hf.py").read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    examples = [e.source for n in nodes for e in doctest.DocTestParser().get_examples(ast.get_docstring(n) or "")]
    assert not examples, f"hf.py has doctest examples that the suite does not run: {examples}"
