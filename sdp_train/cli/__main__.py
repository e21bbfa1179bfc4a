"""``python -m sdp_train.cli``: how launchers start a rank process (torchrun, ``sdp train``'s own)."""

from sdp_train.cli import rank_main

rank_main()
