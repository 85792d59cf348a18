"""staging.arena: one allocation of zeroed, aligned, non-overlapping views per kind (on the CPU,
and page-locked where a GPU is visible); staging.span: one view over views end to end."""

from __future__ import annotations

import pytest
import torch

ARENA_SPECS = [((3, 5), torch.bfloat16), ((7,), torch.float64), ((), torch.float32), ((0,), torch.float32),
               ((2, 2, 3), torch.float16), ((11,), torch.float32)]


def _nbytes(specs) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for shape, dt in specs)


def _check_arena(views, specs) -> None:
    """Zeroed views of the requested shapes and dtypes, all in one storage exactly their size,
    not overlapping, each aligned to its element size."""
    assert [(tuple(v.shape), v.dtype) for v in views] == [(tuple(s), d) for s, d in specs]
    assert all(bool((v == 0).all()) for v in views)
    storages = {v.untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1, storages
    assert views[0].untyped_storage().nbytes() == _nbytes(specs)
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views if v.numel())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert all(v.data_ptr() % v.element_size() == 0 for v in views)
    for i, v in enumerate(views):  # NOTE: writing one view leaves the others as they were
        v.fill_(i + 1)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))


def test_arena_is_one_allocation_of_views_on_cpu():
    from flcomm.collectives.staging import arena

    _check_arena(arena(ARENA_SPECS, "cpu"), ARENA_SPECS)


def test_span_is_one_view_over_tensors_end_to_end_and_none_otherwise():
    from flcomm.collectives.staging import arena, span

    specs = [((3, 5), torch.float32), ((0,), torch.float32), ((7,), torch.float32), ((2, 2), torch.float32)]
    views = arena(specs, "cpu")
    for i, v in enumerate(views):
        v.copy_(torch.arange(v.numel(), dtype=v.dtype).view(v.shape) + 100 * i)
    flat = span(views)
    assert flat is not None and flat.shape == (15 + 7 + 4,)
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in views]))
    flat[0] = -1.0  # a view, not a copy
    assert views[0][0, 0] == -1.0
    assert torch.equal(span(views[2:]), torch.cat([v.reshape(-1) for v in views[2:]]))
    # not end to end, not in order, separate storages, mixed dtypes, nothing: None
    assert torch.equal(span([views[0], views[2]]), flat[:22])  # the empty one between takes no room
    assert span([views[0], views[3]]) is None
    assert span([views[2], views[0]]) is None
    assert span([torch.zeros(3), torch.zeros(3)]) is None
    mixed = arena([((4,), torch.float32), ((4,), torch.float32)], "cpu")
    assert span([mixed[0], mixed[1].view(torch.int32)]) is None
    assert span([]) is None


@pytest.mark.gpu
def test_pinned_arena_pins_exactly_its_bytes():
    """Page-locked with cudaHostRegister: the views are pinned, the caching host allocator (which
    rounds each allocation up to a power of two) holds nothing more, and the views copy to and
    from the device asynchronously, exactly."""
    from flcomm.collectives.staging import arena

    specs = [((1000, 37), torch.float32), ((12345,), torch.bfloat16), ((999,), torch.float64)]
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("allocated_bytes.current", 0) if stats else 0
    views = arena(specs, "cpu", pin=True)
    assert all(v.is_pinned() for v in views)
    if stats:
        assert stats().get("allocated_bytes.current", 0) == before
    _check_arena(views, specs)
    dev = [torch.randn(v.shape, device="cuda").to(v.dtype) for v in views]
    for v, d in zip(views, dev):
        v.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert all(torch.equal(v, d.cpu()) for v, d in zip(views, dev))
    del views, v  # NOTE: the last view gone: unregistered (a new arena registers again)
    again = arena(specs, "cpu", pin=True)
    assert all(v.is_pinned() for v in again)
