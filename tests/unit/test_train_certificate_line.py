"""`sdp train`'s certificate line: properties of the mask, gamma's optimality ratio as a design figure."""

from __future__ import annotations

from masklab import Mask, analyze
from sdp_train.trainer.outputs import mask_lines


def test_certificate_line_prints_no_guarantee_and_labels_gamma_a_design_figure():
    mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    line = mask_lines(mask, analyze(mask))[-1]
    assert "not guarantees for this run" in line and "no theorem covers AdamW" in line
    ratio = line.index("optimality ratio")
    assert "a design figure: no stepwise theorem uses gamma" in line[ratio:]


def test_mask_lines_say_how_many_losses_the_mask_survives_and_what_a_loss_does():
    mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    line = next(line for line in mask_lines(mask, analyze(mask)) if "redundancy" in line)
    assert "any 1 simultaneous worker loss (min coverage - 1)" in line
    assert "fatal: {0,1} {0,2} {1,2} (3 sets of 2 workers)" in line
    assert ("with --on-worker-loss continue (B-SDP, N-SDP, Bb-SDP, overlap averaging) the survivors go on without "
            "rollback, with --restore-coverage on a mask redesigned for them, with --max-rejoins until a replacement "
            "takes the lost row back") in line


def test_the_share_no_mask_removes_is_sdp_plans_for_the_run(tmp_path):
    """Issue 27, item 5: `sdp train` prints `predict`'s ``unmaskable`` for the run it starts (its mask, AC,
    FSDP, batch and loss chunks), and nothing where nothing is planned (overlap averaging)."""
    from sdp_train.cli.train import unmaskable_line
    from sdp_train.planning.memory import predict
    from sdp_train.trainer.config import TrainConfig
    from sdp_train.trainer.memory import format_bytes
    from sdp_train.trainer.prepare import prepare

    cfg = TrainConfig(model="llama-debug", mode="bsdp", active=0.5, workers=4, fsdp=True, activation_checkpointing=True,
                      batch_size=2, seq_len=32, out=str(tmp_path))
    prep = prepare(cfg)
    plan = predict("llama-debug", mode="bsdp", workers=4, mask=prep.mask, ac=True, fsdp=True, batch_size=2, seq_len=32)
    line = unmaskable_line(prep)
    assert f"no mask removes {format_bytes(plan['unmaskable'])} of the largest rank's predicted peak " \
           f"{format_bytes(plan['total'])} ({plan['unmaskable'] / plan['total']:.0%})" in line
    assert "sharded over all ranks" in line
    assert unmaskable_line(prepare(TrainConfig(model="llama-debug", mode="overlap", workers=4, out=str(tmp_path)))) is None
