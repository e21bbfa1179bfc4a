"""``sdp data`` writes token shards and their ``shards.json``; ``--data bin:DIR`` reads them back.

Round trips text -> shards -> the batches ``sdp train`` trains on, with the byte tokenizer and a
local Hugging Face tokenizer (built here, nothing downloaded); a directory without ``shards.json``
still reads as uint16; a sidecar's vocabulary larger than the model's, an unfinished write, an
unlisted or truncated shard and bad inputs are each one error naming the file, exit 2.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdp_train.cli import main
from sdp_train.cli.train import check_data
from sdp_train.data import build_batches, load_token_shard
from sdp_train.data.shards import SIDECAR, read_format
from sdp_train.errors import ConfigError, DataFileError
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.prepare import prepare

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (20 + i) for i in range(12)]


def _texts(root, docs=DOCS):
    root.mkdir()
    for i, doc in enumerate(docs):
        (root / f"doc_{i:02d}.txt").write_text(doc, encoding="utf-8")
    return root


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(("sdp data: error: ", "sdp train: error: ")), err
    return err[0]


def test_byte_shards_round_trip_into_the_batches_sdp_train_reads(tmp_path, capsys):
    texts = _texts(tmp_path / "texts")
    out = tmp_path / "shards"
    assert main(["data", str(texts), "--out", str(out), "--shard-tokens", "4000"]) == 0
    assert f"--data bin:{out}" in capsys.readouterr().out
    fmt = read_format(out)
    assert (fmt.dtype, fmt.vocab_size, fmt.tokenizer, fmt.eot_id) == ("uint16", 256, "bytes", None)
    train = b"".join(DOCS[i].encode() for i in range(12) if (i + 1) % 10)  # document 9 (the 10th) is validation
    shards = sorted(out.glob("train_*.bin"))
    assert len(shards) == -(-len(train) // 4000) and [fmt.files[p.name] for p in shards[:-1]] == [4000] * (len(shards) - 1)
    assert np.concatenate([load_token_shard(p) for p in shards]).tobytes() == np.frombuffer(train, np.uint8).astype("<u2").tobytes()
    assert bytes(load_token_shard(out / "val_00000.bin").astype(np.uint8)) == DOCS[9].encode()

    prep = prepare(TrainConfig(mode="ddp", workers=2, data=f"bin:{out}", seq_len=16, batch_size=4))
    check_data(prep)  # what sdp train checks before launch
    assert (prep.data.token_dtype, prep.data.token_vocab) == ("uint16", 256)
    batches = build_batches(prep.data, split="train", seed=0, rank=1, world_size=2)
    inputs, targets = next(batches)
    for row, target, segment, start in zip(inputs, targets, batches.window_segment[batches.indices(0)],
                                           batches.window_start[batches.indices(0)]):
        window = np.frombuffer(shards[segment].read_bytes(), "<u2")[start:start + 17]
        assert row.tolist() == window[:-1].tolist() and target.tolist() == window[1:].tolist()
        assert bytes(row.tolist()).decode() in train.decode()


def test_fewer_files_than_val_every_give_the_last_files_tail_to_validation(tmp_path):
    texts = _texts(tmp_path / "texts", DOCS[:1])
    assert main(["data", str(texts / "doc_00.txt"), "--out", str(tmp_path / "s"), "--val-every", "4"]) == 0
    fmt = read_format(tmp_path / "s")
    tokens = len(DOCS[0].encode())
    assert fmt.files == {"train_00000.bin": tokens - tokens // 4, "val_00000.bin": tokens // 4}


def _hf_tokenizer(root, words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    return root, vocab


def test_a_local_hf_tokenizers_ids_and_eos_reach_the_shards(tmp_path):
    pytest.importorskip("tokenizers")
    words = sorted({w for doc in DOCS for w in doc.replace(".", " . ").replace(":", " : ").split()})
    tok_dir, vocab = _hf_tokenizer(tmp_path / "tok", words)
    texts = _texts(tmp_path / "texts")
    assert main(["data", str(texts), "--out", str(tmp_path / "s"), "--tokenizer", str(tok_dir)]) == 0
    fmt = read_format(tmp_path / "s")
    assert (fmt.dtype, fmt.vocab_size, fmt.eot_id) == ("uint16", len(vocab), vocab["</s>"])
    val = load_token_shard(tmp_path / "s" / "val_00000.bin").tolist()
    names = {i: w for w, i in vocab.items()}
    assert val[-1] == vocab["</s>"] and "<unk>" not in (names[i] for i in val)
    assert " ".join(names[i] for i in val[:-1]) == " ".join(DOCS[9].replace(".", " . ").replace(":", " : ").split())
    assert len(json.loads((tmp_path / "s" / SIDECAR).read_text())["files"]) == 2


def test_uint32_shards_and_a_vocabulary_larger_than_the_models_is_refused(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(70_000)]
    tok_dir, vocab = _hf_tokenizer(tmp_path / "tok", words)
    texts = _texts(tmp_path / "texts", [" ".join(words[j] for j in range(i, 70_000, 997)) for i in range(3)])
    assert main(["data", str(texts), "--out", str(tmp_path / "s"), "--tokenizer", str(tok_dir)]) == 0
    fmt = read_format(tmp_path / "s")
    assert fmt.dtype == "uint32" and (tmp_path / "s" / "train_00000.bin").stat().st_size == 4 * fmt.files["train_00000.bin"]
    assert load_token_shard(tmp_path / "s" / "train_00000.bin", "uint32")[1] == vocab["w997"]  # above uint16's range
    capsys.readouterr()
    argv = ["train", "--mode", "ddp", "--workers", "1", "--steps", "1", "--batch-size", "2", "--seq-len", "8",
            "--data", f"bin:{tmp_path / 's'}", "--out", str(tmp_path / "run"), "--no-save"]
    assert main(argv) == 2
    err = _err(capsys)
    assert f"{tmp_path / 's' / SIDECAR} says the shards hold ids of a {len(vocab)}-id vocabulary" in err
    assert "model 'llama-debug' embeds 256" in err


def test_header_less_shards_still_read_as_uint16(tmp_path):
    np.arange(1000, dtype="<u2").tofile(tmp_path / "train_000.bin")
    np.arange(1000, dtype="<u2").tofile(tmp_path / "val_000.bin")
    prep = prepare(TrainConfig(mode="ddp", data=f"bin:{tmp_path}", model_overrides={"vocab_size": 1000}))
    assert (prep.data.token_dtype, prep.data.token_vocab) == ("uint16", None)


@pytest.mark.parametrize("damage", ["unfinished", "unlisted", "truncated", "bad-json", "bad-dtype"])
def test_a_damaged_shard_directory_is_refused_naming_the_file(tmp_path, damage):
    out = tmp_path / "s"
    assert main(["data", str(_texts(tmp_path / "texts")), "--out", str(out)]) == 0
    meta = json.loads((out / SIDECAR).read_text())
    if damage == "unfinished":
        meta["files"] = None
    elif damage == "bad-dtype":
        meta["dtype"] = "int8"
    (out / SIDECAR).write_text("{" if damage == "bad-json" else json.dumps(meta))
    if damage == "unlisted":
        np.arange(100, dtype="<u2").tofile(out / "extra.bin")
    if damage == "truncated":
        (out / "train_00000.bin").write_bytes((out / "train_00000.bin").read_bytes()[:-2])
    message = {"unfinished": "still being written", "unlisted": "extra.bin is not listed in",
               "truncated": "train_00000.bin has", "bad-json": "cannot be read as JSON",
               "bad-dtype": "dtype 'int8' is not one of uint16, uint32"}[damage]
    with pytest.raises((ConfigError, DataFileError), match=message) as err:
        prepare(TrainConfig(mode="ddp", data=f"bin:{out}"))
    assert str(out) in str(err.value)


@pytest.mark.parametrize("case", ["missing", "not-empty", "no-match", "not-utf8", "no-tokenizer", "val-every"])
def test_bad_sdp_data_input_is_one_line_naming_it_and_leaves_nothing(tmp_path, capsys, case):
    texts = _texts(tmp_path / "texts", DOCS[:3])
    out = tmp_path / "s"
    argv = ["data", str(texts), "--out", str(out)]
    if case == "missing":
        argv[1] = str(tmp_path / "nope.txt")
    elif case == "not-empty":
        out.mkdir()
        (out / "keep").write_text("x")
    elif case == "no-match":
        argv += ["--glob", "*.md"]
    elif case == "not-utf8":
        pytest.importorskip("tokenizers")
        (texts / "doc_01.txt").write_bytes(b"caf\xe9\n")
        argv += ["--tokenizer", str(_hf_tokenizer(tmp_path / "tok", ["a"])[0])]
    elif case == "no-tokenizer":
        argv += ["--tokenizer", str(tmp_path / "no-such-dir")]
    else:
        argv += ["--val-every", "1"]
    assert main(argv) == 2
    err = _err(capsys)
    named = {"missing": "nope.txt", "not-empty": f"--out {out}", "no-match": "'*.md' (--glob)",
             "not-utf8": "doc_01.txt is not UTF-8", "no-tokenizer": "no-such-dir",
             "val-every": "--val-every 1"}[case]
    assert named in err
    assert (case == "not-empty") == out.exists()
