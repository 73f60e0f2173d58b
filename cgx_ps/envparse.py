"""Settings read from environment variables, parsed one way for shards and workers alike.

An unset or empty variable means "use the default"; a malformed one raises ``error`` (each
configuration passes its own class) with a message naming the variable and its value.

Every number a user can set has a ``Bounds``: the one check behind the shard's flags and
variables (server/config.py, cli.py) and the worker's variables (worker/config.py), so nan, inf,
a negative count or a value that can only be a typo is refused where it is read, named as the
user wrote it, instead of failing later inside gRPC, asyncio or a kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, TypeVar

T = TypeVar("T")

__all__ = ["Bounds", "PORT", "env_flag", "env_number", "env_str", "plain_number"]


@dataclass(frozen=True)
class Bounds:
    """The values a numeric setting accepts: ``low``..``high`` (``low`` itself excluded when
    ``above``), finite, an integer where ``integer``, or the one value ``off`` (e.g. -1: disabled)."""

    low: float
    high: float
    integer: bool = True
    above: bool = False  # > low, not >= low (a timeout of 0 that would mean "fail at once")
    off: int | None = None
    unit: str = ""  # what the number counts ("seconds", "MiB"), for the message

    def describe(self) -> str:
        """The accepted range as a user reads it: "an integer in 0..65535 or -1 (off)"."""
        number = "an integer" if self.integer else "a number"
        unit = f" of {self.unit}" if self.unit else ""
        low, high = plain_number(self.low), plain_number(self.high)
        text = f"{number}{unit} > {low} and <= {high}" if self.above else f"{number}{unit} in {low}..{high}"
        return text + (f" or {self.off} (off)" if self.off is not None else "")

    def problem(self, value: float) -> str | None:
        """Why ``value`` is refused ("must be ..."), or None."""
        if self.off is not None and value == self.off:
            return None
        inside = math.isfinite(value) and (value > self.low if self.above else value >= self.low) \
            and value <= self.high and (not self.integer or value == int(value))
        return None if inside else f"must be {self.describe()}"

    def parse(self, text: str) -> int | float:
        """``text`` as this setting's number; ValueError "must be ..." otherwise."""
        try:
            value: int | float = int(text) if self.integer else float(text)
        except ValueError:
            value = math.nan  # refused below, with the same message as any other bad value
        problem = self.problem(value)
        if problem:
            raise ValueError(problem)
        return value


PORT = Bounds(0, 65535)  # a TCP port; 0 picks a free one


def plain_number(x: float) -> str:
    """1048576, not 1.04858e+06: a number as the user would type it."""
    return str(int(x)) if math.isfinite(x) and x == int(x) else f"{x:g}"


def env_number(env: Mapping[str, str], name: str, default: T, bounds: Bounds,
               error: type[Exception] = ValueError) -> T | int | float:
    """The variable ``name`` checked against ``bounds``, else ``default`` (not checked: the code's own)."""
    value = env.get(name, "")
    if value == "":
        return default
    try:
        return bounds.parse(value)
    except ValueError as exc:
        raise error(f"{name}={value!r}: {exc}") from None


def env_flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    """On unless empty, "0" or "false" (as the deploy manifests write it)."""
    value = env.get(name)
    if value is None:
        return default
    return value not in ("", "0", "false")


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "")
    return value if value != "" else default
