"""Run under torchrun by test_timeouts.py: rank 1 never joins the step; rank 0 must fail, not hang.

    python -m torch.distributed.run --standalone --nproc-per-node 2 stall_script.py MASK.json OUTDIR
"""

from __future__ import annotations

import sys
import time

from sdp_train.data import build_batches
from sdp_train.parallel.dist import default_device
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.launch import destroy_distributed, init_distributed
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run, loss_fn


def main() -> None:
    mask, out = sys.argv[1], sys.argv[2]
    device = default_device()
    info = init_distributed(device)
    try:
        prep = prepare(TrainConfig(model="llama-debug", mode="bsdp", workers=2, active=None, mask=mask,
                                   batch_size=2, seq_len=16, out=out))
        run = Run(prep, info, device)
        if info.rank == 1:
            time.sleep(30)  # a stuck rank: it never takes part in the step's collectives
            return
        inputs, targets = next(build_batches(prep.data, split="train", seed=0, rank=0, world_size=2))
        loss_fn(run.train_model(inputs), targets).backward()  # waits for rank 1 when backward ends
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
