"""A store whose value is dropped while its copy is in flight leaves its block to that copy; the next
store of the same size takes the block in stream order (its copy waits for the copies still touching
it) instead of making a new pinned chunk. Counted on the host backend with slowed copies
(``host_copy_delay_us``), where every store goes through a copy stream as a GPU's does; its snapshot
staging is plain memory beside the pinned arena, as a GPU's staging is device memory beside it."""

import torch

import offcache
from offcache import engine as _engine

MiB = 1 << 20
CPU = torch.device("cpu")


def _filled(n: int, value: int) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


def test_store_and_drop_takes_the_dropped_block_instead_of_a_new_chunk(engine_config):
    # Each copy takes 200 ms: far longer than the caller's snapshot even on a loaded machine, so the
    # next store comes while it is in flight (a store that comes later takes the block freed instead).
    engine_config(backend="host", host_copy_delay_us=200_000, min_chunk="1MiB")
    size = 16 * MiB
    kept = _engine.store([_filled(MiB, 7)], CPU)  # something in use, as in a real run
    src = torch.empty(size, dtype=torch.uint8)
    src.fill_(0)
    _engine.store([src], CPU)  # the first store makes the value's chunk; its result dies at once
    first = offcache.stats()
    checked = []
    for i in range(1, 16):
        src.fill_(i)  # a new version each time: no dedup hit
        out = _engine.store([src], CPU)
        if i % 5 == 0:  # some values are read back: intact, though their block was reused
            _engine.wait_stored(out[0])
            checked.append(bool(torch.equal(out[0], _filled(size, i))))
        del out
    offcache.synchronize()
    s = offcache.stats()
    made = s["chunks_made"] - first["chunks_made"]
    reused = s["blocks_reused_in_order"] - first["blocks_reused_in_order"]
    assert checked == [True, True, True], checked
    assert made == 0, f"{made} new chunks after the first store (reused in order: {reused})"
    assert reused >= 8, f"only {reused} of 15 stores took the dropped block in stream order"
    # Peak pinned reserved: the value's block (twice while one is read back) plus what is kept.
    assert s["peak_pinned_reserved_bytes"] <= 2 * size + 2 * MiB, s["peak_pinned_reserved_bytes"] / MiB
    assert s["staging_reserved_bytes"] >= size, "the snapshots' staging is counted apart from the pinned arena"
    assert torch.equal(kept[0], _filled(MiB, 7))


def test_a_reused_block_holds_the_new_value_and_is_read_after_it_is_written(engine_config):
    """The dropped value's block is still being written by its own slow D2H copy when the next store
    takes it: that store's copy runs behind it (the new bytes land last), a fetch of the new value
    reads them only once written, and a value whose block a fetch still reads is not taken."""
    engine_config(backend="host", host_copy_delay_us=100_000, min_chunk="1MiB")
    size = 4 * MiB
    before = offcache.stats()["blocks_reused_in_order"]
    a = _engine.store([_filled(size, 1)], CPU)
    del a  # its copy has 100 ms to run
    b = _engine.store([_filled(size, 2)], CPU)
    assert offcache.stats()["blocks_reused_in_order"] == before + 1, "the store did not take the block in flight"
    back, ticket = _engine.fetch(b, CPU, False)  # after b's copy, which is after a's
    del b  # held by the fetch until it completes: not free to take
    c = _engine.store([_filled(size, 3)], CPU)
    _engine.wait_on_host(ticket)
    _engine.wait_stored(c[0])
    assert torch.equal(back[0], _filled(size, 2)), "the fetch read the block before its new value landed"
    assert torch.equal(c[0], _filled(size, 3))
    offcache.synchronize()
    assert offcache.stats()["deferred_bytes"] == 0
