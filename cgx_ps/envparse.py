"""Settings read from environment variables, parsed one way for shards and workers alike.

An unset or empty variable means "use the default"; a malformed one raises ``error`` (each
configuration passes its own class) with a message naming the variable and its value.
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

T = TypeVar("T")

__all__ = ["env_flag", "env_float", "env_int", "env_str"]


def _env_number(env: Mapping[str, str], name: str, default: T, parse: Callable[[str], T], what: str,
                error: type[Exception]) -> T:
    value = env.get(name, "")
    if value == "":
        return default
    try:
        return parse(value)
    except ValueError:
        raise error(f"{name}={value!r} is not {what}") from None


def env_int(env: Mapping[str, str], name: str, default: int, error: type[Exception] = ValueError) -> int:
    return _env_number(env, name, default, int, "an integer", error)


def env_float(env: Mapping[str, str], name: str, default: float, error: type[Exception] = ValueError) -> float:
    return _env_number(env, name, default, float, "a number", error)


def env_flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    """On unless empty, "0" or "false" (as the deploy manifests write it)."""
    value = env.get(name)
    if value is None:
        return default
    return value not in ("", "0", "false")


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "")
    return value if value != "" else default
