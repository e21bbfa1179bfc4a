"""The runtime refuses, in one line, a `kernels` module that is not this project's."""

import importlib
import sys
import types

import pytest


def test_a_foreign_kernels_package_is_named_instead_of_failing_later(monkeypatch):
    import sdp_train.parallel.sync as ours

    foreign = types.ModuleType("kernels")
    foreign.__file__ = "/site-packages/kernels/__init__.py"
    monkeypatch.setitem(sys.modules, "kernels", foreign)
    monkeypatch.delitem(sys.modules, "sdp_train.parallel.sync", raising=False)
    with pytest.raises(ImportError, match=r"/site-packages/kernels/__init__.py.*not this project's"):
        importlib.import_module("sdp_train.parallel.sync")
    monkeypatch.undo()  # puts back the module the rest of the session imported
    assert importlib.import_module("sdp_train.parallel.sync") is ours


def test_the_dev_extra_keeps_transformers_below_the_release_that_brings_the_other_kernels():
    import transformers
    from packaging.version import Version

    assert Version(transformers.__version__) < Version("5.25"), (
        "transformers >= 5.25 installs Hugging Face's `kernels`, which shadows this project's")
