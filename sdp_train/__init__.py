"""sdp_train: the SDP runtime on torch.distributed and the ``sdp`` command line.

Importing this package imports no torch; the command line loads each subcommand lazily so that
``sdp design`` and ``sdp inspect`` stay fast and work without a GPU stack. The library API
(docs/api.md) is loaded on first use: ``from sdp_train import SubnetworkDataParallel``.
"""

_API = {"SubnetworkDataParallel": "sdp_train.api", "SDP": "sdp_train.api", "MLPSpec": "sdp_train.sdp_blocks",
        "find_blocks": "sdp_train.sdp_blocks", "OverlapAveraging": "sdp_train.overlap"}

__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'sdp_train' has no attribute {name!r}")
