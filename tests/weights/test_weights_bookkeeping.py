"""The prefetch table's rules that no engine run can time: a generation judged only after the copy landed."""

import torch

from offcache.weights import bookkeeping


class _Ticket:
    """A GPU copy still in flight until the host waits for it (its stream wait alone lands nothing)."""

    def __init__(self):
        self.landed = False
        self.stream_waits = 0

    def query(self) -> bool:
        return self.landed

    def issued(self) -> bool:
        return True

    def wait(self) -> None:
        self.stream_waits += 1


class _Region:
    """A node-region cache whose generation another rank bumps while this rank's copy has not run yet."""

    def __init__(self, ticket):
        self.ticket, self.judged_in_flight = ticket, []

    def is_fresh(self, offloaded, tag) -> bool:
        self.judged_in_flight.append(not self.ticket.landed)
        return True

    def finish(self, fetched, offloaded):
        return fetched


def test_a_region_copy_is_judged_fresh_only_after_it_landed(monkeypatch):
    """A GPU consumer's wait is a stream wait: the generation read on the host before the copy ran could not see
    a write another rank starts after that read and before the DMA (torn bytes handed out as fresh)."""
    ticket = _Ticket()
    cache = _Region(ticket)
    monkeypatch.setattr(bookkeeping._engine, "wait_on_host", lambda t: setattr(t, "landed", True))
    source, copy = torch.zeros(4), torch.zeros(4)
    device = torch.device("cuda", 0)
    bookkeeping.WEIGHTS.prefetched[id(source)] = bookkeeping.Prefetched(
        offloaded=source, cache=cache, onloaded=copy, ticket=ticket, device=device, version=source._version,
        target=0, nbytes=source.nbytes, tag=2,
    )  # fmt: skip
    waits = bookkeeping.WEIGHTS.counters["weight_host_waits"]
    assert bookkeeping.WEIGHTS.take_prefetched(source, device) is copy
    assert cache.judged_in_flight == [False] and ticket.landed
    assert bookkeeping.WEIGHTS.counters["weight_host_waits"] == waits + 1
    # A copy of a tensor no other process writes (no tag) keeps the stream wait alone.
    ticket2, other = _Ticket(), torch.zeros(4)
    bookkeeping.WEIGHTS.prefetched[id(other)] = bookkeeping.Prefetched(
        offloaded=other, cache=_Region(ticket2), onloaded=copy, ticket=ticket2, device=device,
        version=other._version, target=0, nbytes=other.nbytes,
    )  # fmt: skip
    assert bookkeeping.WEIGHTS.take_prefetched(other, device) is copy
    assert not ticket2.landed and ticket2.stream_waits == 1
