"""GetBlob calls: existing and missing keys, bad timeouts and keys, cancelled waits."""

from __future__ import annotations

import math

from cgx_ps.v1 import ps_pb2

from ..world import Identity, Plan
from .registry import scenario

def get_request(key: str, timeout_s: float, who: Identity) -> bytes:
    return ps_pb2.GetBlobRequest(key=key, timeout_s=timeout_s, session_id=who.session_id).SerializeToString()


@scenario("GetBlob")
def getblob_existing(rng, w, who):
    key = rng.choice(w.blob_keys) if w.blob_keys else "blob/0"
    return Plan([get_request(key, 0.5, who)])


@scenario("GetBlob")
def getblob_missing(rng, w, who):
    return Plan([get_request(f"missing/{rng.randrange(1 << 30)}", rng.choice((0.01, 0.2, 1.0)), who)])


@scenario("GetBlob")
def getblob_bad_timeout(rng, w, who):
    timeout_s = rng.choice((math.nan, math.inf, -math.inf, -1.0, 3600.5, 1e308, 5e-324, 0.0))
    return Plan([get_request(f"missing/{rng.randrange(1 << 30)}", timeout_s, who)])


@scenario("GetBlob")
def getblob_bad_key(rng, w, who):
    return Plan([get_request(rng.choice(("", "k" * 257, "é" * 129)), 0.1, who)])


@scenario("GetBlob")
def getblob_cancelled(rng, w, who):
    return Plan([get_request(f"missing/{rng.randrange(1 << 30)}", 30.0, who)], ending="cancel")
