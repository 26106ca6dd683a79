"""read_ahead: items in order, buffers recycled, the reader's error raised in the consumer, and a
consumer that stops early leaves no reader thread behind."""
from __future__ import annotations

import threading

import pytest

from deepseek_flash.store.readahead import read_ahead


def counting_fill(count):
    def fill(take, give):
        for i in range(count):
            buf = take()
            if buf is None:
                return
            buf[0] = i
            give(buf, (i, buf[0]))
    return fill


def test_items_arrive_in_order_through_few_buffers():
    bufs = [bytearray(1) for _ in range(2)]
    assert list(read_ahead(bufs, counting_fill(10))) == [(i, i) for i in range(10)]


def test_any_error_of_the_reader_is_raised_in_the_consumer():
    def fill(take, give):
        give(take(), "first")
        raise KeyError("reader broke")

    items = read_ahead([bytearray(1)] * 2, fill)
    assert next(items) == "first"
    with pytest.raises(KeyError, match="reader broke"):
        next(items)


def test_a_consumer_that_stops_early_joins_the_reader():
    before = set(threading.enumerate())
    items = read_ahead([bytearray(1)], counting_fill(1000), name="ra-test")
    assert next(items) == (0, 0)
    items.close()
    assert not [t for t in set(threading.enumerate()) - before if t.name == "ra-test"]
