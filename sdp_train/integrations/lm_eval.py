"""Downstream evaluation with lm-eval's Hugging Face backend: `export_hf` and `evaluate` (docs/eval.md).

`export_hf` turns the ``model.safetensors`` of an ``sdp train`` run of a built-in LLaMA into a Hugging
Face ``LlamaForCausalLM`` directory (``config.json``, ``model.safetensors``, the tokenizer). The names
map one to one and no weight is permuted: the built-in model rotates the halves of each head
(``rotate_half``) as Hugging Face's does, with the same RMSNorm (float32, eps inside the root), SwiGLU
MLP, bias-free projections and untied head. The tokenizer is the run's: one id per byte for byte-level
data (the standard library's bytes, ``sdp data --tokenizer bytes`` shards), else the local tokenizer
directory ``sdp data`` recorded in the shards' ``shards.json``. `evaluate` runs ``lm_eval.simple_evaluate``
with the ``hf`` backend on such a directory, or on any Hugging Face causal LM directory (a run of your
own ``--model FILE.py:FACTORY`` writes ``config.json``), and returns each task's accuracies.

Not here: the other built-in families (image models), generation settings, and downloads: lm-eval
fetches the tasks' datasets itself when online; a task defined in local files runs offline.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from masklab.io import atomic_write_text
from sdp_train.data.shards import read_format
from sdp_train.errors import ConfigError
from sdp_train.models import LlamaConfig, get_model_config, model_class
from sdp_train.parallel.blockmap import on_meta
from sdp_train.parallel.export import save_safetensors

PAPER_TASKS: tuple[str, ...] = ("arc_easy", "boolq", "hellaswag", "openbookqa", "sciq")
"""lm-eval's names of the SDP paper's five downstream tasks: ARC-Easy, BoolQ, HellaSwag, OpenBookQA, SciQ."""
BYTES = "bytes"
"""The tokenizer spec of byte-level data: one id per byte, 256 ids (`byte_tokenizer`)."""
INSTALL = "pip install 'sdp-toolkit[eval]'"
MODEL_FILE = "model.safetensors"  # what sdp train writes (sdp_train.trainer.outputs) and from_pretrained reads
SUMMARY_FILE = "summary.json"  # sdp train's record of the run, with its config
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_LAYER_NAMES = {  # built-in name inside ``layers.i.`` -> Hugging Face's inside ``model.layers.i.``
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
_OUTER_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def is_hf_model_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a Hugging Face model directory (it has ``config.json``) that ``from_pretrained`` reads."""
    return (Path(path) / "config.json").is_file()


def hf_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A built-in LLaMA's full state dict under Hugging Face ``LlamaForCausalLM``'s names (the same tensors)."""
    renamed = {}
    for name, tensor in state.items():
        layer, _, rest = name.removeprefix("layers.").partition(".")
        if name in _OUTER_NAMES:
            renamed[_OUTER_NAMES[name]] = tensor
        elif name.startswith("layers.") and layer.isdigit() and rest in _LAYER_NAMES:
            renamed[f"model.layers.{layer}.{_LAYER_NAMES[rest]}"] = tensor
        else:
            raise ConfigError(f"tensor {name!r} of the built-in LLaMA has no Hugging Face LlamaForCausalLM name")
    return renamed


def hf_config(config: LlamaConfig, *, eos_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> Any:
    """The ``transformers.LlamaConfig`` of the built-in LLaMA `config` (no bias, untied head, full-head KV)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_heads,
        head_dim=config.head_dim, hidden_act="silu", max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
        dtype=str(dtype).removeprefix("torch."), architectures=["LlamaForCausalLM"],
    )


def byte_tokenizer(*, max_length: int | None = None) -> Any:
    """A Hugging Face tokenizer with one id per byte: UTF-8 text -> its bytes, ids 0..255, as the byte models read.

    Built locally (``tokenizers``' BPE with no merges over the 256 byte tokens ``<0x00>``..``<0xFF>``, every
    character falling back to its bytes). Its end-of-text and padding token is byte 0, which text does
    not hold; the literal text ``<0x00>`` is read as that token too. Nothing is prepended.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={f"<0x{b:02X}>": b for b in range(256)}, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    kwargs = {} if max_length is None else {"model_max_length": max_length}
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<0x00>", pad_token="<0x00>", **kwargs)


def export_hf(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, tokenizer: str | None = None
              ) -> Path:
    """Write the built-in LLaMA that an ``sdp train`` run saved as a Hugging Face model directory.

    Parameters
    ----------
    run_dir : path
        The run's ``--out``: ``model.safetensors`` and ``summary.json`` (which names the model, its
        overrides and the data).
    out_dir : path
        New or empty directory: ``config.json``, ``model.safetensors`` and the tokenizer's files, which
        ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load.
    tokenizer : {"bytes"} or path, optional
        ``"bytes"`` or a local Hugging Face tokenizer directory; default the run's (`run_tokenizer`).

    Returns
    -------
    Path
        `out_dir`.

    Raises
    ------
    ConfigError
        `run_dir` holds no finished run of a built-in LLaMA, its model file does not match the model, its
        tokenizer is unknown or larger than the model's vocabulary, or `out_dir` is not empty.
    """
    run_dir, out = Path(run_dir), Path(out_dir)
    if is_hf_model_dir(run_dir):
        raise ConfigError(f"{run_dir} is already a Hugging Face model (config.json): evaluate it as it is")
    config = run_model_config(run_dir)
    spec = tokenizer if tokenizer is not None else run_tokenizer(run_dir)
    tok = load_tokenizer(spec, max_length=config.max_seq_len)
    if len(tok) > config.vocab_size:
        raise ConfigError(f"tokenizer {spec} has {len(tok)} ids, more than the "
                          f"{config.vocab_size} of model {config.name} in {run_dir}")
    state = _checked_state(run_dir / MODEL_FILE, config)
    _check_new_dir(out)
    dtype = next(iter(state.values())).dtype
    save_safetensors(hf_state_dict(state), out, config=hf_config(config, eos_token_id=tok.eos_token_id, dtype=dtype))
    tok.save_pretrained(out)
    return out


def run_model_config(run_dir: str | os.PathLike[str]) -> LlamaConfig:
    """The built-in LLaMA config of the run in `run_dir`, from its ``summary.json`` (model name and overrides)."""
    run_config = _run_config(Path(run_dir))
    name, overrides = run_config.get("model"), run_config.get("model_overrides") or {}
    if isinstance(name, str) and name.rpartition(":")[0].endswith(".py"):
        raise ConfigError(f"{run_dir} holds your own model {name!r} but no config.json: only a Hugging Face model "
                          "(whose run writes config.json) or a built-in LLaMA converts for lm-eval")
    config = get_model_config(name, **overrides)
    if not isinstance(config, LlamaConfig):
        raise ConfigError(f"{run_dir} holds model {name!r}, not a language model: only the built-in LLaMA models "
                          "convert to a Hugging Face causal LM")
    return config


def run_tokenizer(run_dir: str | os.PathLike[str]) -> str:
    """The tokenizer of the data the run in `run_dir` trained on: ``"bytes"`` or a local tokenizer directory.

    The standard library's bytes (``--data auto``, ``stdlib``) are bytes; token shards (``bin:DIR``) say
    their tokenizer in ``DIR/shards.json``.
    """
    data = _run_config(Path(run_dir)).get("data", "auto")
    if data in ("auto", "stdlib"):
        return BYTES
    if isinstance(data, str) and data.startswith("bin:") and Path(data[4:]).is_dir():
        spec = read_format(data[4:]).tokenizer
        if spec == BYTES or spec is not None and Path(spec).is_dir():
            return spec
        raise ConfigError(f"the run in {run_dir} trained on shards {data[4:]} whose tokenizer is "
                          f"{'not recorded (no shards.json)' if spec is None else f'{spec!r}, not a directory here'}: "
                          "pass tokenizer (--tokenizer bytes or DIR)")
    raise ConfigError(f"the run in {run_dir} trained on data {data!r}, whose tokenizer cannot be found from here: "
                      "pass tokenizer (--tokenizer bytes or DIR)")


def load_tokenizer(spec: str | os.PathLike[str], *, max_length: int | None = None) -> Any:
    """``"bytes"`` -> `byte_tokenizer`, else the Hugging Face tokenizer saved in directory `spec` (no download)."""
    if spec == BYTES:
        return byte_tokenizer(max_length=max_length)
    if not any((Path(spec) / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"tokenizer {spec} is neither 'bytes' nor a directory holding a Hugging Face tokenizer "
                          f"({' or '.join(_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(spec), local_files_only=True)


def _run_config(run_dir: Path) -> dict[str, Any]:
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory (an sdp train --out or a Hugging Face model directory)")
    path = run_dir / SUMMARY_FILE
    if not (run_dir / MODEL_FILE).is_file() or not path.is_file():
        raise ConfigError(f"{run_dir} has no config.json (a Hugging Face model) and no {MODEL_FILE} with "
                          f"{SUMMARY_FILE} (a finished sdp train run that saved its model)")
    try:
        config = json.loads(path.read_text(encoding="utf-8")).get("config")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path} cannot be read as sdp train's summary: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), str):
        raise ConfigError(f"{path} has no config naming the model (config.model)")
    return config


def _checked_state(path: Path, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The tensors of `path`, refused unless they are exactly the full model of `config` (names and shapes)."""
    from safetensors.torch import load_file

    with on_meta():
        expected = {n: tuple(t.shape) for n, t in model_class(config)(config).state_dict().items()}
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors' own error type for a truncated or foreign file
        raise ConfigError(f"{path} cannot be read as safetensors: {type(exc).__name__}: {exc}") from None
    found = {n: tuple(t.shape) for n, t in state.items()}
    if found != expected:
        wrong = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise ConfigError(f"{path} is not the full model {config.name} of its run: tensors {wrong[:3]} differ "
                          f"({len(wrong)} in all) in name or shape")
    return state


# -- evaluation ------------------------------------------------------------------------------------
def import_lm_eval() -> Any:
    """The ``lm_eval`` package, or a `ConfigError` saying how to install it."""
    try:
        import lm_eval
        import lm_eval.tasks
    except ImportError as exc:
        raise ConfigError(f"evaluating needs lm-eval, which cannot be imported ({exc}): {INSTALL}") from None
    return lm_eval


def evaluate(model_dir: str | os.PathLike[str], tasks: Sequence[str] = PAPER_TASKS, *, tokenizer: str | None = None,
             include_path: str | os.PathLike[str] | None = None, limit: int | None = None, batch_size: int = 8,
             device: str | None = None, hf_out: str | os.PathLike[str] | None = None,
             samples_out: str | os.PathLike[str] | None = None) -> dict[str, dict[str, float]]:
    """Accuracies of a model on lm-eval tasks, zero-shot, with lm-eval's ``hf`` backend.

    Parameters
    ----------
    model_dir : path
        A Hugging Face causal LM directory (``config.json``), used as it is, or an ``sdp train`` run of a
        built-in LLaMA, converted with `export_hf` into `hf_out` (default a temporary directory).
    tasks : sequence of str
        lm-eval task names; default `PAPER_TASKS`. lm-eval downloads their datasets when online.
    tokenizer : {"bytes"} or path, optional
        Default: the Hugging Face directory's own tokenizer, else the run's (`run_tokenizer`).
    include_path : path, optional
        A directory of lm-eval task YAML files (tasks of your own, on local data).
    limit : int, optional
        Only the first `limit` documents of each task (a quick check, not a result).
    batch_size : int
        Sequences per forward pass.
    device : str, optional
        ``cuda``, ``cuda:1``, ``cpu``, ...; default ``cuda`` when there is one, else ``cpu``.
    hf_out : path, optional
        New or empty directory that keeps the Hugging Face model converted from a run.
    samples_out : path, optional
        A JSON-lines file of every document scored: task, ``doc_id``, ``target``, ``responses`` (for a
        multiple-choice task each choice's ``[log-likelihood, is greedy]``) and its metrics.

    Returns
    -------
    dict
        Task -> ``{"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "samples"}`` (the metrics the
        task reports; ``samples``: documents scored).
    """
    lm_eval = import_lm_eval()
    tasks = _checked_tasks(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a positive number of documents, got {limit!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    # everything refusable is refused before lm-eval indexes its tasks and a large model converts
    model_dir, convert = Path(model_dir), not is_hf_model_dir(model_dir)
    spec = _tokenizer_spec(model_dir, tokenizer)
    if hf_out is not None and not convert:
        raise ConfigError(f"hf_out (--hf-out) keeps the conversion of an sdp train run; {model_dir} is already a "
                          "Hugging Face model")
    if hf_out is not None:
        _check_new_dir(Path(hf_out))
    if samples_out is not None and not Path(samples_out).parent.is_dir():
        raise ConfigError(f"samples file {samples_out}: directory {Path(samples_out).parent} does not exist")
    manager = _task_manager(lm_eval, tasks, include_path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="sdp-eval-") as scratch:
        if convert:  # sdp data tokenizes without special tokens: no BOS before the text, as in training
            pretrained = tok_dir = export_hf(model_dir, hf_out or Path(scratch, "hf"), tokenizer=spec)
            model_args = {"pretrained": str(pretrained), "tokenizer": str(tok_dir), "add_bos_token": False}
        else:
            tok_dir = _tokenizer_dir(spec, model_dir, Path(scratch, "tokenizer"))
            model_args = {"pretrained": str(model_dir), "tokenizer": str(tok_dir)}
        results = lm_eval.simple_evaluate(
            model="hf", model_args=model_args, tasks=list(tasks),
            batch_size=batch_size, device=device, limit=limit, task_manager=manager,
            log_samples=samples_out is not None)
    if samples_out is not None:
        atomic_write_text(samples_out, "".join(json.dumps(record) + "\n" for record in sample_records(results)))
    return tidy_results(results)


def tidy_results(results: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's results -> task -> metric -> number (``"acc,none"`` becomes ``"acc"``; "N/A" dropped)."""
    tidy = {}
    for task, metrics in results["results"].items():
        row = {key.removesuffix(",none"): float(value) for key, value in metrics.items()
               if "," in key and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if task in results.get("n-samples", {}):
            row["samples"] = results["n-samples"][task]["effective"]
        tidy[task] = row
    return tidy


def sample_records(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """lm-eval's logged samples -> one JSON-ready record per document: ``task``, ``doc_id``, ``target``,
    ``responses`` (what the model answered, after the task's filter) and the document's metrics."""
    records = []
    for task, samples in results.get("samples", {}).items():
        for sample in samples:
            record = {"task": task, "doc_id": sample["doc_id"], "target": sample["target"],
                      "responses": sample["filtered_resps"]}
            record.update({m: sample[m] for m in sample.get("metrics", ()) if m in sample})
            records.append(json.loads(json.dumps(record, default=str)))  # tuples -> lists, anything else -> text
    return records


def _checked_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    if not tasks or not all(isinstance(t, str) and t for t in tasks):
        raise ConfigError(f"tasks must be one or more lm-eval task names, got {tasks!r}")
    return tasks


def _task_manager(lm_eval: Any, tasks: tuple[str, ...], include_path: str | os.PathLike[str] | None) -> Any:
    """lm-eval's index of the tasks, refusing unknown names. Tasks all found in `include_path` are indexed
    alone: indexing lm-eval's own tasks (about 14,000 names) takes about 10 CPU-seconds."""
    TaskManager = lm_eval.tasks.TaskManager
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ConfigError(f"include path {include_path} is not a directory of lm-eval task YAML files")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = "lm-eval's tasks" + ("" if include_path is None else f" or {include_path}")
        raise ConfigError(f"unknown lm-eval task(s) {', '.join(unknown)}: not among {where}")
    return manager


def _tokenizer_spec(model_dir: Path, tokenizer: str | None) -> str | None:
    """The tokenizer to evaluate `model_dir` with (None: the Hugging Face directory's own), checked to load."""
    if is_hf_model_dir(model_dir):
        if tokenizer is None and any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
            return None
        if tokenizer is None and not (model_dir / SUMMARY_FILE).is_file():
            raise ConfigError(f"{model_dir} holds a Hugging Face model without a tokenizer "
                              f"({' or '.join(_TOKENIZER_FILES)}): pass tokenizer (--tokenizer bytes or DIR)")
        try:
            vocab = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("vocab_size")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{model_dir / 'config.json'} cannot be read as a Hugging Face config: {exc}") from None
    else:
        vocab = run_model_config(model_dir).vocab_size
    spec = tokenizer if tokenizer is not None else run_tokenizer(model_dir)
    size = len(load_tokenizer(spec))
    if isinstance(vocab, int) and size > vocab:
        raise ConfigError(f"tokenizer {spec} has {size} ids, more than the {vocab} of the model in {model_dir}")
    return spec


def _check_new_dir(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"{path} must be a new or empty directory for the Hugging Face model")


def _tokenizer_dir(spec: str | None, model_dir: Path, scratch: Path) -> Path:
    """A directory holding the tokenizer `spec` names for lm-eval (the byte tokenizer saved into `scratch`)."""
    if spec is None:
        return model_dir
    if spec != BYTES:
        return Path(spec)
    byte_tokenizer().save_pretrained(scratch)
    return scratch
