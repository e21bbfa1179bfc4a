"""Other libraries' training loops driving `SubnetworkDataParallel` (docs/api.md).

`hf`: Hugging Face's ``transformers.Trainer``. Each module imports its library when it is imported
itself; importing `sdp_train` imports none of them.
"""
