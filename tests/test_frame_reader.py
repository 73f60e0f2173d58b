"""The raw data plane's sans-IO frame reader (rawframes.FrameReader), which both ends drive: every
split of a byte stream into receives yields the same frames, a body is received in place, and an
oversized header is refused before its body exists."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgx_ps.net.raw_frames import SMALL_FRAME, Frame, FrameReader, FrameTooLarge, frame_header

frames = st.lists(st.tuples(st.booleans(), st.binary(max_size=600)), max_size=12)


def encode(items: list[tuple[bool, bytes]]) -> bytes:
    return b"".join(frame_header(len(body), status) + body for status, body in items)


def feed(reader: FrameReader, data: bytes, cuts: list[int]) -> list[Frame]:
    """Deliver ``data`` as a socket would: each receive at most the next cut's size, and never
    more than ``buffer()`` has room for."""
    out, at, sizes = [], 0, iter(cuts)
    while at < len(data):
        room = reader.buffer()
        n = min(len(room), len(data) - at, max(1, next(sizes, len(data))))
        room[:n] = data[at:at + n]
        at += n
        if (frame := reader.advance(n)) is not None:
            out.append(frame)
    return out


@settings(max_examples=200, deadline=None)
@given(frames, st.lists(st.integers(1, 700), max_size=80))
def test_any_split_of_the_stream_reads_the_same_frames(items, cuts):
    reader = FrameReader()
    got = feed(reader, encode(items), cuts)
    assert [(f.status, bytes(f.body)) for f in got] == items
    assert not reader.started  # every frame whole: EOF here is between frames


def test_a_large_body_is_handed_on_as_the_buffer_it_was_received_into():
    reader = FrameReader()
    body = bytes(range(256)) * (SMALL_FRAME // 256 + 1)
    data = frame_header(len(body)) + body
    [frame] = feed(reader, data, [4, len(body)])
    assert isinstance(frame.body, memoryview) and bytes(frame.body) == body
    [small] = feed(reader, frame_header(3) + b"abc", [])
    assert isinstance(small.body, bytes) and small.body == b"abc"


def test_an_oversized_header_is_refused_before_its_body_is_allocated():
    reader = FrameReader(limit=100)
    room = reader.buffer()
    room[:4] = frame_header(101)
    with pytest.raises(FrameTooLarge, match="frame of 101 bytes; at most 100") as info:
        reader.advance(4)
    assert (info.value.size, info.value.limit) == (101, 100)
    assert len(reader.buffer()) == 4  # still reading a header: nothing was allocated for the body
    reader.limit = 200  # the limit may change between frames
    assert feed(reader, frame_header(101) + b"x" * 101, []) == [Frame(False, b"x" * 101)]


def test_started_tells_eof_inside_a_frame_from_eof_between_frames_and_reset_forgets_it():
    reader = FrameReader()
    assert not reader.started
    reader.buffer()[:2] = frame_header(5)[:2]
    reader.advance(2)
    assert reader.started  # inside a header
    reader.buffer()[:2] = frame_header(5)[2:]
    assert reader.advance(2) is None
    assert reader.started and len(reader.buffer()) == 5  # inside a body
    reader.reset()
    assert not reader.started and len(reader.buffer()) == 4


def test_an_empty_status_frame_is_whole_on_its_header():
    reader = FrameReader()
    reader.buffer()[:4] = frame_header(0, status=True)
    assert reader.advance(4) == Frame(True, b"")
