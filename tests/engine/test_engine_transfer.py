"""``to_device``: step and boundary metadata to the device (plain tensors on the CPU)."""

from __future__ import annotations

import pytest
import torch

from growpage.engine.loop.transfer import to_device


@pytest.mark.parametrize("dtype", [torch.int32, torch.long, torch.bool])
def test_lists_and_tensors_become_tensors_of_the_dtype(dtype):
    cpu = torch.device("cpu")
    t = to_device([[1, 0], [0, 3]], dtype, cpu)
    assert t.dtype == dtype and t.device == cpu
    assert t.tolist() == torch.tensor([[1, 0], [0, 3]], dtype=dtype).tolist()
    src = torch.tensor([5, 6, 7])
    u = to_device(src, dtype, cpu)
    assert u.dtype == dtype and u.tolist() == src.to(dtype).tolist()


def test_a_ragged_list_is_refused():
    with pytest.raises(ValueError):
        to_device([[1, 2], [3]], torch.long, torch.device("cpu"))
