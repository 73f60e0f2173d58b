"""Protocol sequences, one module per RPC: each ``@scenario(method)`` function makes the Plan of
one call of that method. Importing this package registers every one of them."""

from . import exchange, getblob, probe, putblob, register, setcodecs  # noqa: F401 - importing registers them
from .registry import SCENARIOS, Scenario, scenario

__all__ = ["SCENARIOS", "Scenario", "scenario"]
