"""memtide.cli.train_job, the job behind `memtide run`: where it trains."""

from __future__ import annotations

import pytest

import memtide
from memtide.cli import train_job


@pytest.mark.skipif(memtide.cuda_status()["usable"], reason="needs a machine without a usable GPU")
def test_device_cuda_without_a_gpu_says_there_is_none():
    # It said memtide "sees a usable GPU" whenever torch could not use one, a GPU or not.
    with pytest.raises(RuntimeError, match="--device cuda: no usable GPU: ") as e:
        train_job.choose_device("cuda")
    assert "sees a usable GPU" not in str(e.value)
    assert memtide.cuda_status()["reason"] in str(e.value)
