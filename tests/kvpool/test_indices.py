import numpy as np
import pytest
import torch

from kvpool import INDEX_DTYPE, SENTINEL, AllocatorError, PoolConfig, get_preset, padded
from kvpool.indices import as_indices, check_range


def test_padding_is_always_the_sentinel():
    dirty = np.array([7, 8, 9], dtype=np.int32)
    out = padded(dirty, 6)
    assert out.tolist() == [7, 8, 9, SENTINEL, SENTINEL, SENTINEL] and out.dtype == INDEX_DTYPE
    dirty[0] = 99  # the input is copied, not aliased
    assert out[0] == 7
    with pytest.raises(AllocatorError, match="cannot pad"):
        padded(dirty, 2)


def test_as_indices_is_int32_read_only_and_refuses_junk():
    out = as_indices(np.array([1, 2], dtype=np.int64))
    assert out.dtype == np.int32 and not out.flags.writeable
    assert as_indices([]).dtype == np.int32
    for bad, msg in (
        [np.array([[1, 2]]), "1-D"],
        [np.array([0.5]), "integers"],
        [np.array([2**31], dtype=np.int64), "int32"],
    ):
        with pytest.raises(AllocatorError, match=msg):
            as_indices(bad)


def test_check_range_refuses_sentinel_and_overflow():
    check_range(np.array([1, 9], dtype=np.int32), 10, "x")
    for bad in ([0], [10], [-3]):
        with pytest.raises(AllocatorError, match="must lie in"):
            check_range(np.array(bad, dtype=np.int32), 10, "x")
    with pytest.raises(AllocatorError, match="int32"):
        check_range(np.array([1], dtype=np.int64), 10, "x")


def test_device_auto():
    cfg = PoolConfig(get_preset("tiny-full"), 4, max_tokens=64)
    assert cfg.device == ("cuda" if torch.cuda.is_available() else "cpu")
