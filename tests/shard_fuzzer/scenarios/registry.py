"""The protocol scenarios by method: ``@scenario(method)`` registers a function that makes one
call's Plan; a method's scenarios keep their definition order (the corpus and a case's choice
depend on it)."""

from __future__ import annotations

import random
from typing import Callable

from ..settings import METHODS
from ..world import Identity, Plan, World

Scenario = Callable[[random.Random, World, Identity], Plan]
SCENARIOS: dict[str, list[Scenario]] = {m: [] for m in METHODS}


def scenario(method: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        SCENARIOS[method].append(fn)
        return fn
    return register
