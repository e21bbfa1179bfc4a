"""On CUDA the runtime turns NCCL's resource sharing for split communicators on before the default
group exists (NCCL reads NCCL_COMM_SPLIT_SHARE_RESOURCES once, at its first communicator), keeps a
value the user set, and leaves gloo alone. `init_process_group` is recorded, not run: this machine
has no GPU; scripts/gpu_check.sh measures what sharing saves on one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sdp_train.parallel.dist import NCCL_SPLIT_SHARE_ENV, split_resources_shared
from sdp_train.trainer import launch


@pytest.fixture
def recorded_init(monkeypatch):
    """torchrun's environment, and `init_process_group` replaced by a recorder of its backend and of
    the sharing variable as NCCL would read it at that moment."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv(NCCL_SPLIT_SHARE_ENV, "restored at teardown")  # init_distributed sets it in os.environ
    monkeypatch.delenv(NCCL_SPLIT_SHARE_ENV)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    calls = []
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kwargs: calls.append((backend, launch.os.environ.get(NCCL_SPLIT_SHARE_ENV))))
    return calls


def test_nccl_default_group_is_created_with_split_sharing_on(recorded_init):
    launch.init_distributed(torch.device("cuda", 0), preload=())
    assert recorded_init == [("nccl", "1")]
    assert split_resources_shared()


def test_a_users_zero_keeps_split_communicators_apart(recorded_init, monkeypatch):
    monkeypatch.setenv(NCCL_SPLIT_SHARE_ENV, "0")
    launch.init_distributed(torch.device("cuda", 0), preload=())
    assert recorded_init == [("nccl", "0")]
    assert not split_resources_shared()


def test_gloo_runs_leave_the_variable_unset(recorded_init):
    launch.init_distributed(torch.device("cpu"), preload=())
    assert recorded_init == [("gloo", None)]
