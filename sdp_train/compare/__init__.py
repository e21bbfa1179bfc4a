"""``sdp compare``: train DDP, FSDP and the SDP variants on one budget and report them side by side.

`runner` designs, verifies and trains every system; `stats` aggregates seeds; `report` writes
compare.json, compare.md and the plots.
"""


def __getattr__(name: str):
    """Release 0.1's ``sdp_train.compare.X`` (now in `runner`), for one more release."""
    import importlib
    import warnings

    runner = importlib.import_module("sdp_train.compare.runner")
    if name.startswith("__") or not hasattr(runner, name):
        raise AttributeError(f"module 'sdp_train.compare' has no attribute {name!r}")
    warnings.warn(f"sdp_train.compare.{name} moved to sdp_train.compare.runner.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(runner, name)
