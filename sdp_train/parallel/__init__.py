"""The SDP library: wrap any ``nn.Module`` so that each worker trains its subnetwork (docs/api.md).

Read it in this order: `discovery` finds a model's blocks and `blockmap` records which tensors
(or slices) each block owns; `masking` cuts one worker's subnetwork from its mask row; `sync`
plans buckets and averages every held slice among its holders over `dist`'s process groups,
counting bytes with `wire`; `schedule` moves blocks and optimizer state when the mask changes;
`parts` resolves masks and applies holder-set FSDP and activation checkpointing (`parallelize`);
`compile` compiles each block with torch.compile;
`cut` cuts a full model to one worker's part; `wrapper` is `SubnetworkDataParallel`, which
delegates to its sync (`strategies`), its `rounds` and their `changes`, and its `fullmodel`;
`overlap` is `OverlapAveraging`, and `export` assembles the full model. This package imports
neither the trainer nor the model families.
"""
