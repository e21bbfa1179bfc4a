"""``sdp data``: token shards for ``sdp train --data bin:DIR`` from local text files.

Parses, calls `sdp_train.data.shards.write_shards` and prints what it wrote; the format and the
split rule are documented there. Nothing is downloaded: the tokenizer is byte-level or a Hugging
Face tokenizer saved in a local directory.
"""

from __future__ import annotations

import argparse

from sdp_train.data.shards import DEFAULT_SHARD_TOKENS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "data", help="write token shards (sdp train --data bin:DIR) from local text files",
        description="Tokenize local text files into uint16/uint32 token shards and a shards.json that says "
                    "their dtype, vocabulary size and token counts; sdp train --data bin:DIR reads them and "
                    "refuses a model whose vocabulary is smaller. Each file is one document; every "
                    "VAL_EVERY-th file goes to the validation shards (with fewer files, the last 1/VAL_EVERY of "
                    "the last file's tokens). Nothing is downloaded.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, or directories whose files matching --glob are read (recursively, sorted)")
    p.add_argument("--out", required=True, metavar="DIR", help="new or empty directory for the shards")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|DIR",
                   help="'bytes' (one id per byte, 256 ids; default) or a local Hugging Face tokenizer directory "
                        "(tokenizer.json through the tokenizers package, else transformers' AutoTokenizer); its "
                        "eos token, if any, ends every document")
    p.add_argument("--glob", default="*.txt", metavar="PATTERN",
                   help="files read from an input directory (default *.txt)")
    p.add_argument("--val-every", default=10, type=int, metavar="N",
                   help="every N-th file is validation data (default 10)")
    p.add_argument("--shard-tokens", default=DEFAULT_SHARD_TOKENS, type=int, metavar="N",
                   help=f"tokens per shard file at most (default {DEFAULT_SHARD_TOKENS:,})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sdp_train.data.shards import open_tokenizer, write_shards

    tokenizer = open_tokenizer(args.tokenizer)
    fmt = write_shards(args.inputs, args.out, tokenizer=tokenizer, pattern=args.glob, val_every=args.val_every,
                       shard_tokens=args.shard_tokens)
    train = {n: t for n, t in fmt.files.items() if not n.startswith("val")}
    val = {n: t for n, t in fmt.files.items() if n.startswith("val")}
    print(f"sdp data: {sum(train.values()):,} training tokens in {len(train)} shard(s), {sum(val.values()):,} "
          f"validation tokens in {len(val)}; {fmt.dtype} ids of tokenizer {fmt.tokenizer} "
          f"(vocab_size {fmt.vocab_size}) -> {args.out}")
    print(f"sdp data: train with: sdp train --data bin:{args.out} (a model with vocab_size >= {fmt.vocab_size})")
    return 0
