"""Generated messages: any request type filled from its descriptor with hostile values."""

from __future__ import annotations

import random

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from .settings import REQUEST_TYPES
from .values import SCALAR_KINDS, pick_bytes, pick_double, pick_int, pick_text

def random_value(rng: random.Random, f: FieldDescriptor):
    if f.type in SCALAR_KINDS:
        return pick_int(rng, SCALAR_KINDS[f.type])
    if f.type == FieldDescriptor.TYPE_DOUBLE:
        return pick_double(rng)
    if f.type == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if f.type == FieldDescriptor.TYPE_STRING:
        return pick_text(rng)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return pick_bytes(rng)
    raise TypeError(f"no generator for field {f.full_name} of type {f.type}")


def fill_message(rng: random.Random, message: Message, depth: int = 0) -> Message:
    """Set a random subset of ``message``'s fields (in place) to hostile values. Setting both
    members of a oneof keeps the last, so the oneof's case is random too."""
    for f in message.DESCRIPTOR.fields:
        if rng.random() < 0.35:
            continue  # unset: proto3 defaults (0, "", empty) are values worth sending too
        if f.is_repeated:
            fill_repeated(rng, message, f, depth)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(message, f.name)
            sub.SetInParent()
            if depth < 4:
                fill_message(rng, sub, depth + 1)
        else:
            setattr(message, f.name, random_value(rng, f))
    return message


def fill_repeated(rng: random.Random, message: Message, f: FieldDescriptor, depth: int) -> None:
    container = getattr(message, f.name)
    huge = depth <= 1 and rng.random() < 0.03  # many elements, up to about the 8 MiB limit
    count = rng.randrange(10_000, 300_000) if huge else rng.choice((0, 1, 1, 2, 3, 5))
    if f.type != FieldDescriptor.TYPE_MESSAGE:
        value = random_value(rng, f) if huge else None
        if isinstance(value, (str, bytes)):
            value = value[:16]  # a huge list of huge strings would not fit in a message
        container.extend([value] * count if huge else [random_value(rng, f) for _ in range(count)])
        return
    if huge:
        element = type(container.add())()
        fill_message(rng, element, depth + 3)  # shallow: the count is what is huge
        del container[:]
        container.extend([element] * count)
        return
    for _ in range(count):
        fill_message(rng, container.add(), depth + 1)


def generated_message(rng: random.Random, method: str) -> bytes:
    return fill_message(rng, REQUEST_TYPES[method]()).SerializeToString()
