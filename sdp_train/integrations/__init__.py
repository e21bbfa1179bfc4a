"""Other libraries driving sdp_train's models.

`hf`: Hugging Face's ``transformers.Trainer`` training a `SubnetworkDataParallel` model (docs/api.md);
it imports transformers when it is imported itself. `lm_eval`: lm-eval's Hugging Face backend scoring
a run's model on downstream tasks (docs/eval.md); it imports lm-eval and transformers only when
called, since ``sdp eval``'s parser imports it. Importing `sdp_train` imports none of them.
"""
