"""Process-wide worker state: the configuration and the one communication engine."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Sequence

from .. import timeline
from ..v1 import ps_pb2
from .config import WorkerConfig
from .shards.engine import CommEngine, EngineShare
from .errors import ConfigError
from .pipeline.blocks import merge_layouts
from .pipeline.codec_threads import apply_thread_plan, host_thread_plan

__all__ = ["init", "shutdown", "current_config", "engine_for_layout", "engines_for_layouts", "connected_engine", "rank",
           "size"]

log = logging.getLogger(__name__)
_lock = threading.Lock()
_config: WorkerConfig | None = None
_engine: CommEngine | None = None


def init(config: WorkerConfig | None = None, **overrides: object) -> WorkerConfig:
    """Set up this process as a worker of the job: who it is and where the shards are.

    Call it once, before creating a ``DistributedOptimizer`` or a ``DDPHookState``; calling it
    again without arguments returns the same configuration. The shards are dialled later, when
    the first front end registers. Also starts the timeline (``CGX_PS_TIMELINE``) if asked for.

    Args:
        config: the job's configuration; default: read from the environment
            (``WorkerConfig.from_env``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``CGX_PS_SERVERS``, ...).
        **overrides: fields that replace what the environment says (e.g. ``servers=(...)``).

    Returns:
        The configuration now in force.

    Raises:
        ConfigError: a missing or malformed variable or credential file, named.
    """
    global _config
    with _lock:
        if _config is None or config is not None or overrides:
            _config = config or WorkerConfig.from_env(**overrides)
        # CGX_PS_TIMELINE: a bad step range or folder fails here, not at exit
        timeline.start_from_env(os.environ, "rank", _config.rank, f"worker rank {_config.rank} "
                                f"({_config.node_id}, local rank {_config.local_rank})", _config.rank,
                                ConfigError, handle_sigterm=True)
        return _config


def configured() -> WorkerConfig | None:
    """The config ``init()`` set, or None before it."""
    return _config


def current_config() -> WorkerConfig:
    if _config is None:
        raise ConfigError("call cgx_ps.worker.init() first")
    return _config


def rank() -> int:
    return current_config().rank


def size() -> int:
    return current_config().world_size


def engine_for_layout(layout: ps_pb2.Layout) -> tuple[CommEngine, WorkerConfig]:
    """Start the communication engine and register the layout with every shard."""
    engines, config = engines_for_layouts([layout])
    return engines[0], config


def engines_for_layouts(layouts: Sequence[ps_pb2.Layout]) -> tuple[list[CommEngine | EngineShare], WorkerConfig]:
    """Start the communication engine and register these layouts with every shard, as one
    session (several models of one process: ``merge_layouts``); one engine (share) per layout."""
    global _engine
    config = current_config()
    with _lock:
        if _engine is not None:
            raise ConfigError("one DistributedOptimizer per process: this process already registered its "
                              "model with the shards (one session per process); several DDP models (a GAN) "
                              "work: create each one's DDPHookState before the first backward")
        layout, offsets = merge_layouts(layouts)
        # The node is what the shards count; each local rank speaks for it as one member.
        plan = host_thread_plan(config.servers, config.local_world_size, config.codec_threads)
        apply_thread_plan(plan)
        log.info("codec threads: %d block(s) at once x %d per call (%s)", plan.codec_workers, plan.kernel_threads,
                 plan.reason)
        engine = CommEngine(config, node_id=config.node_id, num_nodes=config.num_nodes, member=config.local_rank,
                            codec_threads=plan.codec_workers)
        try:
            engine.connect(layout)
        except BaseException:
            engine.close()
            raise
        _engine = engine
        if len(layouts) == 1:
            return [engine], config
        return [EngineShare(engine, offset, i) for i, offset in enumerate(offsets)], config


def connected_engine() -> CommEngine:
    if _engine is None:
        raise ConfigError("create the DistributedOptimizer before broadcasting: broadcasts travel through "
                          "the shards' session, which the optimizer opens")
    return _engine


def shutdown() -> None:
    """Close the shard connections and the intra-node mappings, and write the timeline's file.

    Runs at interpreter exit too. Every front end of the session stops working (their next step
    raises ``CgxPsError``); to train again, call ``init()`` and create new ones. Safe to call
    more than once.
    """
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is not None:
        engine.close()
    from .intranode.reduction import close_all

    close_all()
    timeline.stop()  # writes CGX_PS_TIMELINE's file


atexit.register(shutdown)
