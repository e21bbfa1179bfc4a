"""No loader runs code from a file: a malicious pickle is refused by every loader a user can reach."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from masklab.errors import MaskFileError
from masklab.io import load_mask
from sdp_train.data import load_cifar_batches
from sdp_train.errors import ConfigError, DataFileError
from sdp_train.trainer.config import load_config_file


class _Exploit:
    """Unpickling this runs ``os.system(touch MARKER)``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _malicious(tmp_path, protocol: int = pickle.HIGHEST_PROTOCOL):
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=protocol))
    return path, marker


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_loader_refuses_a_pickle_that_calls_a_function(tmp_path, protocol):
    path, marker = _malicious(tmp_path, protocol)
    with pytest.raises(DataFileError, match=r"refused to load global (posix|os|nt)\.system"):
        load_cifar_batches([path])
    assert not marker.exists()


def test_cifar_loader_refuses_builtins_eval(tmp_path):
    class Eval:
        def __reduce__(self):
            return eval, ("1 + 1",)

    path = tmp_path / "b"
    path.write_bytes(pickle.dumps({b"data": Eval(), b"labels": []}))
    with pytest.raises(DataFileError, match=r"refused to load global builtins\.eval"):
        load_cifar_batches([path])


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_cifar_loader_still_reads_real_batches_of_every_protocol(tmp_path, protocol):
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": data, b"labels": [3, 7], b"batch_label": b"x"}, protocol=protocol))
    images, labels = load_cifar_batches([path])
    assert images.shape == (2, 3, 32, 32) and labels.tolist() == [3, 7]
    np.testing.assert_array_equal(images.reshape(2, -1), data)


def test_json_loaders_refuse_pickles_without_running_them(tmp_path):
    path, marker = _malicious(tmp_path)
    with pytest.raises(MaskFileError):
        load_mask(path)
    with pytest.raises(ConfigError):
        load_config_file(path)
    assert not marker.exists()
