"""DeviceToHost (runner/staging.py): a step's outputs copied into pinned buffers that are
reused once the host has read them. On the CPU with stand-ins for the pinned buffer and
the event (the logic: layout, reuse, growth); on a GPU for real (-m gpu)."""

from __future__ import annotations

import pytest
import torch

from spindle.runner import staging


class _FakeEvent:
    def __init__(self) -> None:
        self.records = 0

    def record(self, stream) -> None:
        self.records += 1


class _FakeSlot:
    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.event = _FakeEvent()


def _outputs(rows: int, k: int, device: str):
    gen = torch.Generator(device=device).manual_seed(rows)
    tokens = torch.randint(0, 50_000, (rows,), generator=gen, device=device)
    ids = torch.randint(0, 50_000, (rows, k), generator=gen, device=device, dtype=torch.int32)
    logprobs = torch.randn(rows, k, generator=gen, device=device)
    return [tokens, ids, logprobs, torch.zeros(rows, dtype=torch.int64, device=device)]


@pytest.fixture
def fake_pinned(monkeypatch):
    monkeypatch.setattr(staging, "OutputSlot", _FakeSlot)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)


def test_outputs_round_trip_and_slots_are_reused_only_after_release(fake_pinned):
    d2h = staging.DeviceToHost(torch.device("cpu"))
    first = _outputs(5, 3, "cpu")
    slot_a, host_a = d2h.copy(first)
    slot_b, host_b = d2h.copy(_outputs(7, 3, "cpu"))  # a in flight: a new slot
    assert slot_b is not slot_a
    for got, want in zip(host_a, first):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # Each tensor starts on a 16-byte boundary of the one buffer.
    base = slot_a.buffer.data_ptr()
    assert all((t.data_ptr() - base) % 16 == 0 for t in host_a)
    assert slot_a.event.records == 1
    d2h.release(slot_a)
    again = _outputs(2, 3, "cpu")
    slot_c, host_c = d2h.copy(again)
    assert slot_c is slot_a and slot_a.event.records == 2
    assert all(torch.equal(got, want) for got, want in zip(host_c, again))
    # host_b still holds its own values: b was never released, so nothing wrote there.
    assert all(torch.equal(got, want) for got, want in zip(host_b, _outputs(7, 3, "cpu")))


def test_a_larger_step_gets_a_larger_buffer(fake_pinned):
    d2h = staging.DeviceToHost(torch.device("cpu"))
    slot, _ = d2h.copy(_outputs(1, 1, "cpu"))
    d2h.release(slot)
    big = _outputs(1024, 21, "cpu")
    slot_big, host = d2h.copy(big)
    assert slot_big.buffer.numel() >= sum(t.numel() * t.element_size() for t in big)
    assert all(torch.equal(got, want) for got, want in zip(host, big))


@pytest.mark.gpu
def test_copies_from_the_device_after_its_event():
    d2h = staging.DeviceToHost(torch.device("cuda"))
    slots = []
    for rows in (3, 256, 1):
        outputs = _outputs(rows, 6, "cuda")
        torch.cuda._sleep(1_000_000)  # the copies queue behind a busy stream
        slot, host = d2h.copy(outputs)
        slot.event.synchronize()
        assert all(got.is_pinned() for got in host)
        assert all(torch.equal(got, want.cpu()) for got, want in zip(host, outputs))
        d2h.release(slot)
        slots.append(slot)
    assert slots[2] is slots[1]  # (the 256-row slot took the one-row step)
