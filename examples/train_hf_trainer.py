"""B-SDP of a Hugging Face LlamaForCausalLM trained by transformers.Trainer (no download).

    torchrun --standalone --nproc-per-node 2 examples/train_hf_trainer.py --out /tmp/sdp-trainer

Needs transformers < 5.25 and accelerate (Trainer's own requirement). Each rank initialises the
process group, builds the same model from a small LlamaConfig and wraps it; `SDPTrainer` is
Trainer with the wrapper as its data parallelism: it keeps the batch columns the model's forward
names, clips with the norm over every block once, and `save_model` writes the full model, which
``LlamaForCausalLM.from_pretrained(out)`` loads. The data are windows of the bytes of the Python
standard library's own source files, different on each rank. ``--masking backward`` trains Bb-SDP.
See docs/api.md.
"""

import argparse
import os
import pathlib

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from sdp_train import SubnetworkDataParallel
from sdp_train.integrations.hf import SDPTrainer


def byte_windows(count: int, seq_len: int, seed: int) -> list[dict]:
    """`count` examples ``{"input_ids", "labels", "path"}`` cut from the standard library's bytes;
    ``path`` is a column the model does not take, so Trainer drops it."""
    files = sorted(pathlib.Path(os.__file__).parent.glob("*.py"))[:40]
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8).long()
    starts = torch.randint(0, len(data) - seq_len, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": data[s:s + seq_len], "labels": data[s:s + seq_len], "path": "stdlib"}
            for s in starts.tolist()]


def build_trainer(out: str, steps: int, *, masking: str = "forward", mask=None, hidden_size: int = 64,
                  max_grad_norm: float = 1.0, callbacks=None) -> SDPTrainer:
    """The wrapped model and its trainer, the same on every rank (call after init_process_group).
    ``masking="backward"`` is Bb-SDP: every worker runs the full model and trains its half. A
    `masklab.Mask` (with a schedule, say) replaces the designed one."""
    config = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    torch.manual_seed(0)
    model = SubnetworkDataParallel(LlamaForCausalLM(config), active=None if mask is not None else 0.5, mask=mask,
                                   masking=masking)  # active=0.5: each worker holds 2 of the 4 layers
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        disable_tqdm=True,
    )
    # Trainer's data loader gives each rank its own share of the examples
    return SDPTrainer(model=model, args=args, train_dataset=byte_windows(8 * steps * 2, seq_len=64, seed=0),
                      callbacks=callbacks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="sdp-trainer-out")
    parser.add_argument("--masking", choices=("forward", "backward"), default="forward")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun; without it, one process trains alone
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    try:
        trainer = build_trainer(args.out, args.steps, masking=args.masking)
        trainer.train()
        trainer.save_model(args.out)  # model.safetensors + config.json; every rank joins, rank 0 writes
        if trainer.args.process_index == 0:
            full = LlamaForCausalLM.from_pretrained(args.out)
            batch = byte_windows(8, seq_len=64, seed=99)
            ids = torch.stack([example["input_ids"] for example in batch])
            with torch.no_grad():
                print(f"full model reloaded: validation loss {full(input_ids=ids, labels=ids).loss.item():.4f}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
