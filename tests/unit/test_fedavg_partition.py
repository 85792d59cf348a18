"""FedAvg's streaming fragments: partition() splits the tensors (by size) into K contiguous runs of
whole tensors of about equal size, and refuses more fragments than tensors."""

import pytest


def test_fragment_partition():
    from flcomm.federated.shards import partition

    assert partition([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert partition([5] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition([1, 1, 100, 1], 2) == [[0, 1, 2], [3]]  # whole tensors: about equal
    with pytest.raises(ValueError, match="cannot split 2 tensors .* into 4 fragments"):
        partition([100, 1], 4)
