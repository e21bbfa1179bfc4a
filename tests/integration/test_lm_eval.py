"""Downstream evaluation with lm-eval's Hugging Face backend (`sdp_train.integrations.lm_eval`, ``sdp eval``).

The Hugging Face export of a built-in LLaMA computes the built-in model's logits, with a tokenizer that
reads text as its UTF-8 bytes. ``sdp eval`` on a real ``sdp train`` run scores a multiple-choice task
in lm-eval's format, written here with its data (offline): each choice's log-likelihood is the one
the built-in model computes here, and the accuracies are those these give. What cannot be converted
or run is refused in one line.
"""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.integrations.lm_eval import byte_tokenizer, export_hf
from sdp_train.models import build_model, get_model_config
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.outputs import save_model

# not llama-debug's defaults: a rope_theta or norm_eps the export dropped would change the logits
OVERRIDES = {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96, "rope_theta": 500.0, "norm_eps": 1e-2,
             "max_seq_len": 96}


def _write_run(out, model_name="llama-debug", overrides=None, state=None):
    """A run directory as ``sdp train`` leaves it: model.safetensors and summary.json with the run's config."""
    out.mkdir()
    if state is not None:
        save_model(out, state)
    else:
        (out / "model.safetensors").write_bytes(b"")
    config = TrainConfig(model=model_name, model_overrides=overrides or {}, out=str(out)).to_dict()
    (out / "summary.json").write_text(json.dumps({"config": config}))
    return out


def test_the_hf_export_computes_the_built_in_llamas_logits(tmp_path):
    """Every name, the RoPE convention (rotate_half: interleaved pairs would rotate other coordinates),
    rope_theta and norm_eps checked at once, on random bytes at every position up to max_seq_len."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = get_model_config("llama-debug", **OVERRIDES)
    model = build_model(config, seed=3).eval()
    run = _write_run(tmp_path / "run", overrides=OVERRIDES, state=model.state_dict())
    hf_dir = export_hf(run, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = torch.randint(0, 256, (2, config.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens))  # float32's default tolerance
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer("Ärger → 3\n", add_special_tokens=True)["input_ids"] == list("Ärger → 3\n".encode())


@functools.cache
def _byte_tokenizer():
    return byte_tokenizer()


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_the_byte_tokenizer_reads_any_text_as_its_utf8_bytes(text):
    tokenizer = _byte_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text


TASK = """\
task: sdp_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def _questions(n):
    """Questions with choices of different lengths (acc_norm divides by them) and multi-byte characters."""
    gen = torch.Generator().manual_seed(1)
    words = ["def", "class", "return None", "import os", "é", "→ ok", "self.x = 1", "pass", "lambda: 0",
             "for i in x:"]
    return [{"question": f"what comes after line {i} ({'ü' * (i % 3)})?",
             "choices": [words[int(j)] for j in torch.randperm(len(words), generator=gen)[:4]]} for i in range(n)]


def _choice_logliks(model, doc):
    """log p(" " + choice | "Question: ...\\nAnswer:") of each choice, byte by byte, by the built-in model:
    lm-eval's multiple-choice request (context, target_delimiter + choice)."""
    context = f"Question: {doc['question']}\nAnswer:".encode()
    logliks = []
    for choice in doc["choices"]:
        ids = torch.tensor([list(context + f" {choice}".encode())])
        with torch.no_grad():
            logprobs = F.log_softmax(model(ids[:, :-1]).double(), dim=-1)[0]
        logliks.append(float(logprobs[len(context) - 1:].gather(1, ids[0, len(context):, None]).sum()))
    return logliks


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-home" / "datasets"))


def test_sdp_eval_of_a_run_reports_its_models_loglikelihoods_and_accuracies(tmp_path, capsys, offline):
    pytest.importorskip("lm_eval")
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert main(["train", "--model", "llama-debug", "--workers", "1", "--steps", "1", "--mode", "ddp", "--out",
                 str(run), "--max-data-bytes", "300000", "--batch-size", "2"]) == 0
    model = build_model(get_model_config("llama-debug"), seed=0).eval()
    model.load_state_dict(load_file(run / "model.safetensors"))
    docs = _questions(16)
    logliks = [_choice_logliks(model, d) for d in docs]
    preds = [max(range(4), key=ll.__getitem__) for ll in logliks]
    preds_norm = [max(range(4), key=lambda j: ll[j] / len(d["choices"][j])) for ll, d in zip(logliks, docs)]
    differ = [i for i in range(len(docs)) if preds[i] != preds_norm[i]]
    assert differ  # dividing by the choice's length changes some answers
    gen = torch.Generator().manual_seed(2)
    for i, d in enumerate(docs):  # right for acc where it differs from acc_norm: the two metrics differ
        d["label"] = preds[i] if i in differ else int(torch.randint(0, 4, (), generator=gen))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "tiny.yaml").write_text(TASK.format(data=tasks / "docs.jsonl"))
    capsys.readouterr()
    assert main(["eval", str(run), "--tasks", "sdp_tiny_choice", "--include-path", str(tasks), "--device", "cpu",
                 "--batch-size", "16", "--samples", str(tmp_path / "samples.jsonl"), "--json"]) == 0

    reported = json.loads(capsys.readouterr().out)["sdp_tiny_choice"]
    assert reported["samples"] == len(docs)
    assert reported["acc"] == pytest.approx(sum(p == d["label"] for p, d in zip(preds, docs)) / len(docs), abs=1e-12)
    assert reported["acc_norm"] == pytest.approx(sum(p == d["label"] for p, d in zip(preds_norm, docs)) / len(docs),
                                                 abs=1e-12)
    samples = sorted((json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()),
                     key=lambda r: r["doc_id"])
    assert [r["target"] for r in samples] == [d["label"] for d in docs]
    scored = torch.tensor([[ll for ll, _greedy in r["responses"]] for r in samples], dtype=torch.float64)
    torch.testing.assert_close(scored, torch.tensor(logliks, dtype=torch.float64), rtol=1e-5, atol=1e-4)


def _refused(capsys, argv, *messages):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sdp eval: error:"), err
    assert all(m in err[0] for m in messages), err[0]


def test_what_cannot_be_converted_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _refused(capsys, [str(tmp_path / "empty")], "has no config.json (a Hugging Face model) and no model.safetensors")
    _refused(capsys, [str(_write_run(tmp_path / "vit", "vit-tiny"))], "holds model 'vit-tiny', not a language model")
    _refused(capsys, [str(_write_run(tmp_path / "own", "my_model.py:build"))],
             "holds your own model 'my_model.py:build' but no config.json")
    _refused(capsys, [str(_write_run(tmp_path / "llama", "llama-debug")), "--tokenizer", str(tmp_path / "empty")],
             f"tokenizer {tmp_path / 'empty'} is neither 'bytes' nor a directory holding a Hugging Face tokenizer")
    with pytest.raises(ConfigError, match="model.safetensors cannot be read as safetensors"):
        export_hf(tmp_path / "llama", tmp_path / "hf")
    state = build_model(get_model_config("llama-debug", n_layers=2), seed=0).state_dict()
    run = _write_run(tmp_path / "mismatch", "llama-debug", {"n_layers": 3}, state=state)
    with pytest.raises(ConfigError, match=r"is not the full model llama-debug of its run: tensors \['layers.2."):
        export_hf(run, tmp_path / "hf")


def test_without_lm_eval_sdp_eval_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what `import lm_eval` meets when it is not installed
    _refused(capsys, [str(tmp_path)], "evaluating needs lm-eval, which cannot be imported",
             ": pip install 'sdp-toolkit[eval]'")
