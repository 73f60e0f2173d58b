"""Register calls: valid, bad fields, broken and foreign layouts, another job."""

from __future__ import annotations

import random

from cgx_ps.model_layout import layout_hash
from cgx_ps.v1 import ps_pb2

from ..values import U32
from ..world import Plan
from .registry import scenario

@scenario("Register")
def register_valid(rng, w, who):
    return Plan([w.register_request().SerializeToString()])


@scenario("Register")
def register_bad_fields(rng, w, who):
    change = rng.choice([
        dict(layout_hash=rng.choice(("", "0" * 64, w.layout_hash.upper()))),
        dict(num_nodes=rng.choice((0, 2, U32))),
        dict(node_id=rng.choice(("", "n" * 257, "n" * rng.randrange(20_000, 1_000_000)))),
        dict(job_id="j" * rng.choice((257, 100_000))),
        dict(node_id="intruder", member=rng.choice((0, U32))),
    ])
    return Plan([w.register_request(**change).SerializeToString()])


def broken_layout(rng: random.Random, base: ps_pb2.Layout) -> ps_pb2.Layout:
    """A layout that fails validation in one way, its tensor names sometimes huge (the error
    names a tensor: the refusal must not echo a megabyte back)."""
    layout = ps_pb2.Layout()
    layout.CopyFrom(base)
    if rng.random() < 0.5:
        layout.tensors[0].name = "t" * rng.randrange(20_000, 1_000_000)
    block, tensor = layout.blocks[-1], layout.tensors[0]
    how = rng.choice(("order", "shard", "codec", "index", "offset", "numel", "shape", "names", "shards"))
    if how == "order":
        block.block_id += 7
    elif how == "shard":
        block.shard = 3
    elif how == "codec":
        block.codec.bits = 0
    elif how == "index":
        block.segments[0].tensor_index = U32
    elif how == "offset":
        layout.blocks[0].segments[0].offset = 1
    elif how == "numel":
        block.numel += 1
    elif how == "shape":
        tensor.shape[:] = [-x for x in tensor.shape]
    elif how == "names":
        layout.tensors[1].name = tensor.name
    else:
        layout.num_shards = 0
    return layout


@scenario("Register")
def register_bad_layout(rng, w, who):
    layout = broken_layout(rng, w.layout)
    request = w.register_request(layout=layout, layout_hash=layout_hash(layout))
    return Plan([request.SerializeToString()])


@scenario("Register")
def register_foreign_layout(rng, w, who):
    """Valid layouts (right hash) this shard must refuse: two shards, a block over the in-flight
    cap, another model than the session's, or the session's with a huge tensor name."""
    name = rng.choice(list(w.foreign_layouts) + ["huge-name"])
    if name == "huge-name":
        layout = ps_pb2.Layout()
        layout.CopyFrom(w.layout)
        layout.tensors[0].name = "a" + "t" * rng.randrange(20_000, 1_000_000)  # still sorts first
    else:
        layout = w.foreign_layouts[name]
    request = w.register_request(layout=layout, layout_hash=layout_hash(layout))
    return Plan([request.SerializeToString()])


@scenario("Register")
def register_another_job(rng, w, who):
    """Another job: refused while the fuzz session is busy, takes the shard over when it is idle
    (the next member case's Register takes it back)."""
    layout = w.foreign_layouts["other-model"]
    request = w.register_request(member=0, node_id="intruder", job_id=f"intruder-{rng.randrange(100)}",
                                 layout=layout, layout_hash=layout_hash(layout))
    return Plan([request.SerializeToString()])


@scenario("Register")
def register_resumed(rng, w, who):
    """A recovering member (``resume``, as after a shard restart): with an incarnation above the
    session's it starts a resumed session, whose blocks take their rounds from the first pushes
    they accept (the huge rounds of exchange_bad_round among them: they must be refused)."""
    request = w.register_request(resume=True, incarnation=rng.randrange(1, 1 << 20))
    return Plan([request.SerializeToString()])
