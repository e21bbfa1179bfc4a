"""Tests run the Triton code itself: interpreted on CPU-only machines, compiled on a GPU; and torch
uses one intra-op thread per test process unless OMP_NUM_THREADS says otherwise.

TRITON_INTERPRET must be set before `kernels.triton_ops` is imported (Triton reads it when
`@triton.jit` decorates), hence in this root conftest, loaded before any test or doctest module
imports kernels. The module is imported here too, at once: a test that sets TRITON_INTERPRET=0
for the ranks it launches (tests/integration/test_compare.py) must not be the first importer,
or the kernels of every later in-process run would be half compiled, half interpreted.
"""

import os

import torch

# Its docstring's examples are comments (nothing to run: SDPTrainer needs torchrun), and importing it
# imports transformers' Trainer and accelerate, 5-10 s in each pytest-xdist worker's collection; its
# tests import it (tests/unit/test_hf_trainer_surface.py, tests/distributed/test_hf_trainer.py), and
# test_hf_trainer_surface checks that no example there runs anything.
collect_ignore = ["sdp_train/integrations/hf.py"]

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# One intra-op thread per test process unless the caller set OMP_NUM_THREADS, as torchrun gives each
# of its ranks; child processes inherit it. The suite's tensors are small: on 2 cores, with two
# pytest-xdist workers, a second thread only spins (test_estimate and test_norms: 30 CPU-s with two
# threads, 20 with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ["OMP_NUM_THREADS"].isdigit() and os.environ["OMP_NUM_THREADS"].isascii():
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))

try:
    import kernels.triton_ops  # noqa: E402,F401  (after the variable: see above)
except ImportError:  # no triton (it is a Linux-only dependency): the reference backend runs alone
    pass
