"""The L0-beside path's own parts (``serve/beside.py``); the path inside the engine is tested in
test_engine.py (CPU) and test_graphs.py (CUDA)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from deepseek_flash.serve.beside import SIDE_STREAM_PRIORITY, SideStream, protected


class FakeCuda:
    """``torch.cuda``'s stream calls, recorded."""

    def __init__(self):
        self.calls = []
        self.current = "main"

    def Stream(self, device=None, priority=0):          # noqa: N802 -- torch's name
        cuda = self

        class Stream:
            def synchronize(self):
                cuda.calls.append(("synchronize", cuda.current))
        self.calls.append(("Stream", str(device), priority))
        return Stream()

    def stream(self, s):
        @contextlib.contextmanager
        def use():
            saved, self.current = self.current, s
            try:
                yield
            finally:
                self.current = saved
        return use()


def test_the_side_stream_is_made_once_at_the_highest_priority_and_waited_for_alone():
    # The L0 prompt's graph runs at its launch stream's priority: the side stream is more urgent
    # than the main one (0), made at its first use only; inside ``use`` work goes to it and
    # ``active`` says so; at the end the host waits for that stream, not the device.
    torch = SimpleNamespace(cuda=FakeCuda())
    side = SideStream(torch, SimpleNamespace(type="cuda"))
    assert SIDE_STREAM_PRIORITY < 0 and side.stream is None
    for _ in range(2):
        with side.use():
            assert side.active and torch.cuda.current is side.stream
        assert not side.active and torch.cuda.current == "main"
    made = [c for c in torch.cuda.calls if c[0] == "Stream"]
    assert len(made) == 1 and made[0][2] == SIDE_STREAM_PRIORITY
    assert [c for c in torch.cuda.calls if c[0] == "synchronize"] == [("synchronize", "main")] * 2


def test_off_cuda_the_side_stream_is_nothing():
    torch = SimpleNamespace(cuda=FakeCuda())
    side = SideStream(torch, SimpleNamespace(type="cpu"))
    with side.use():
        assert not side.active
    assert torch.cuda.calls == [] and side.stream is None


@pytest.mark.parametrize("slots, need, kept", [
    ({"a": 4, "b": 4}, 3, []),                  # both decode slots beyond the prompt: either may go
    ({"a": 4, "b": 4}, 4, ["a", "b"]),          # the prompt reaches slot 4: neither
    ({"a": 2, "b": 9}, 5, ["a"]),               # only the row whose slot is beyond it
    ({"a": 0, "b": 1}, 1, ["a", "b"]),
])
def test_rows_the_decode_writes_within_the_l0_prompt_are_protected(slots, need, kept):
    gens = {name: SimpleNamespace(sched=name) for name in slots}
    writing = list(gens.values())
    assert protected(writing, {id(gens[n]): s for n, s in slots.items()}, need) == kept
