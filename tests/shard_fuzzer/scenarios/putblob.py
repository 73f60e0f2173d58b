"""PutBlob streams: valid uploads, repeated keys, chunks out of order, bad keys and sizes,
large, cut short, empty."""

from __future__ import annotations

from cgx_ps.v1 import ps_pb2

from ..settings import CAPACITY, STALL_DEADLINE_S
from ..values import U64, log_uniform
from ..world import Plan, blob_chunks, split
from .registry import scenario

@scenario("PutBlob")
def putblob_valid(rng, w, who):
    key = f"blob/{rng.randrange(1 << 30)}"
    data = rng.randbytes(log_uniform(rng, 200_000))
    return Plan(blob_chunks(key, data, who, split(rng, data)), on_ok=lambda: w.blob_keys.append(key))


@scenario("PutBlob")
def putblob_again(rng, w, who):
    """A key already put: with the same bytes (a retry) or other bytes (ALREADY_EXISTS)."""
    key = rng.choice(w.blob_keys) if w.blob_keys else "blob/0"
    data = rng.randbytes(rng.randrange(1, 64))
    return Plan(blob_chunks(key, data, who, split(rng, data)))


@scenario("PutBlob")
def putblob_bad_chunks(rng, w, who):
    key, data = f"blob/{rng.randrange(1 << 30)}", rng.randbytes(rng.randrange(8, 5000))
    pieces = split(rng, data, rng.randint(2, 5))
    chunks = blob_chunks(key, data, who, pieces)
    how = rng.choice(("shuffle", "gap", "overrun", "key", "total"))
    if how == "shuffle":
        rng.shuffle(chunks)
        chunks = chunks if chunks != blob_chunks(key, data, who, pieces) else chunks[::-1]
    elif how == "gap":
        del chunks[rng.randrange(len(chunks) - 1)]
    elif how == "overrun":
        chunks.append(blob_chunks(key, b"more", who, [(len(data), b"more")], total=len(data))[0])
    else:
        off, piece = pieces[-1]
        changed = dict(key=key + "x") if how == "key" else dict(total_bytes=len(data) + 1)
        last = ps_pb2.BlobChunk(key=key, total_bytes=len(data), offset=off, data=piece, node_id=who.node,
                                member=who.member, session_id=who.session_id)
        for name, value in changed.items():
            setattr(last, name, value)
        chunks[-1] = last.SerializeToString()
    return Plan(chunks)


@scenario("PutBlob")
def putblob_bad_key(rng, w, who):
    key = rng.choice(("", "k" * 257, "é" * 129, "\x00"))
    return Plan(blob_chunks(key, b"data", who, [(0, b"data")]))


@scenario("PutBlob")
def putblob_too_big(rng, w, who):
    total = rng.choice((CAPACITY, CAPACITY + 1, 1 << 40, U64))
    return Plan(blob_chunks(f"big/{rng.randrange(1 << 30)}", b"x", who, [(0, b"x")], total=total))


@scenario("PutBlob")
def putblob_large(rng, w, who):
    """A few MiB in 1 MiB chunks: stored until the session ends, within the blob capacity."""
    data = bytes(rng.randrange(1, 4) << 20)
    return Plan(blob_chunks(f"large/{rng.randrange(1 << 30)}", data, who, [(o, data[o:o + (1 << 20)])
                                                                             for o in range(0, len(data), 1 << 20)]))


@scenario("PutBlob")
def putblob_cut_short(rng, w, who):
    data = rng.randbytes(rng.randrange(100, 5000))
    first = blob_chunks(f"cut/{rng.randrange(1 << 30)}", data, who, split(rng, data, 2))[:1]
    return Plan(first, ending=rng.choice(("close", "stall", "cancel")), deadline=STALL_DEADLINE_S)


@scenario("PutBlob")
def putblob_empty_and_idle(rng, w, who):
    return Plan([], ending=rng.choice(("close", "stall")))


@scenario("PutBlob")
def putblob_zero_length(rng, w, who):
    key = f"empty/{rng.randrange(1 << 30)}"
    return Plan(blob_chunks(key, b"", who, []), on_ok=lambda: w.blob_keys.append(key))
