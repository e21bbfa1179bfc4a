"""sdp_train: the SDP runtime on torch.distributed and the ``sdp`` command line.

Importing this package imports no torch; the command line loads each subcommand lazily so that
``sdp design`` and ``sdp inspect`` stay fast and work without a GPU stack. The library API
(docs/api.md) is loaded on first use: ``from sdp_train import SubnetworkDataParallel``.

Packages: `parallel` (the library), `trainer` (``sdp train``), `planning` (``sdp plan``,
``sdp estimate``), `compare` (``sdp compare``), `cli`, `models`, `data` (docs/design.md §6).
The flat module paths of release 0.1 (``sdp_train.api``, ``sdp_train.sync``, ...) still import,
with a DeprecationWarning, until the next release.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_API = {"SubnetworkDataParallel": "sdp_train.parallel.wrapper", "SDP": "sdp_train.parallel.wrapper",
        "MLPSpec": "sdp_train.parallel.discovery", "find_blocks": "sdp_train.parallel.discovery",
        "OverlapAveraging": "sdp_train.parallel.overlap"}

__all__ = sorted(_API)

# Release 0.1's module paths (relative to sdp_train) -> where each module lives now.
MOVED = {
    "api": "parallel.wrapper",
    "overlap": "parallel.overlap",
    "sdp_blocks": "parallel.discovery",
    "models.blocks": "parallel.blockmap",
    "sdp_masking": "parallel.masking",
    "sdp_parts": "parallel.parts",
    "sdp_schedule": "parallel.schedule",
    "sdp_export": "parallel.export",
    "sync": "parallel.sync",
    "wire": "parallel.wire",
    "dist": "parallel.dist",
    "clip_guard": "parallel.clip_guard",
    "parallelize": "parallel.parallelize",
    "subnet": "models.subnet",
    "config": "trainer.config",
    "prepare": "trainer.prepare",
    "run": "trainer.run",
    "train": "trainer.train",
    "checkpoint": "trainer.checkpoint",
    "faults": "trainer.faults",
    "memory": "trainer.memory",
    "run_log": "trainer.log",
    "run_outputs": "trainer.outputs",
    "rundir": "trainer.rundir",
    "user_model": "trainer.user_model",
    "modes": "trainer.modes",
    "plan": "planning.memory",
    "plan_activations": "planning.activations",
    "plan_comm": "planning.comm",
    "plan_costs": "planning.costs",
    "estimate": "planning.constants",
    "compare_report": "compare.report",
    "compare_stats": "compare.stats",
    "train_cli": "cli.train",
    "plan_cli": "cli.plan",
    "compare_cli": "cli.compare",
    "estimate_cli": "cli.estimate",
}


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'sdp_train' has no attribute {name!r}")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module under its old name as the same module object, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.partition(".")[2]
        if fullname.startswith("sdp_train.") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = "sdp_train." + MOVED[spec.name.partition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
