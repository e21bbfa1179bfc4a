"""B-SDP of a Hugging Face LlamaForCausalLM in your own training loop (no download).

    torchrun --standalone --nproc-per-node 2 examples/train_hf_llama.py --out /tmp/sdp-llama

The model is built from a small LlamaConfig and trained as a byte-level language model on the
Python standard library's own source files. SubnetworkDataParallel finds ``model.layers``; every
worker holds half of the decoder layers (a dropped layer becomes a pass-through that accepts
Hugging Face's keyword arguments). The full model is saved with its config.json, so
``LlamaForCausalLM.from_pretrained(out)`` loads it. See docs/api.md.
"""

import argparse
import os
import pathlib

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from sdp_train import SubnetworkDataParallel


def byte_batches(rank: int, batch_size: int, seq_len: int, seed: int = 0):
    """Random windows (batch, seq_len) of the bytes of the standard library's *.py files."""
    files = sorted(pathlib.Path(os.__file__).parent.glob("*.py"))[:40]
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed + rank)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=g)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="sdp-llama-out")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun; without it, one process trains alone
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    try:
        train(args, dist.get_rank() if dist.is_initialized() else 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int) -> None:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = SubnetworkDataParallel(LlamaForCausalLM(config), active=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)

    data = byte_batches(rank, batch_size=8, seq_len=64)
    for step in range(args.steps):
        ids = next(data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if rank == 0 and step % 20 == 0:
            print(f"step {step}: loss {loss.item():.4f}  (worker 0 trains layers {model.held_blocks})")

    model.save_full(args.out)  # model.safetensors + config.json; every rank joins, rank 0 writes
    if rank == 0:
        full = LlamaForCausalLM.from_pretrained(args.out)
        ids = next(byte_batches(rank=99, batch_size=8, seq_len=64))
        with torch.no_grad():
            print(f"full model reloaded: validation loss {full(input_ids=ids, labels=ids).loss.item():.4f}")


if __name__ == "__main__":
    main()
