"""The one exception the codecs raise for bad input, so callers can catch exactly that."""

from __future__ import annotations

__all__ = ["CodecError"]


class CodecError(ValueError):
    """A tensor cannot be encoded, or a payload cannot be decoded.

    The message names what was wrong (which field, which bucket or element, expected vs. found),
    so that a server can hand it back to the client that sent the bad block.
    """
