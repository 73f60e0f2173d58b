"""Who this worker is and where the shards are, from the environment torchrun and Kubernetes set.

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE     torchrun (defaults: a single process)
    GROUP_RANK or NODE_RANK                            the node's index (torchrun multi-node)
    CGX_PS_NODE_RANK, CGX_PS_NUM_NODES                 override, for `torchrun --standalone` on
                                                       each node (Kubernetes Indexed Jobs: the
                                                       node rank is JOB_COMPLETION_INDEX)
    CGX_PS_SERVERS                                     "host:port,host:port" or a template with
                                                       {i}, expanded for i < CGX_PS_NUM_SHARDS
    CGX_PS_JOB_ID                                      the same for every worker of one job
    CGX_PS_INCARNATION, else TORCHELASTIC_RESTART_COUNT which start of the job this is, as this
                                                       node's launcher counts it: a hint, the shards
                                                       count the job's starts (server/session/admission.py)
    CGX_PS_INTRANODE                                   how local ranks reduce: auto (CUDA IPC for
                                                       models on a GPU, else shared memory), shm
                                                       (host shared memory even for GPU models),
                                                       or cuda
    CGX_PS_RECOVERY_TIMEOUT                            seconds to wait for a shard that went away
                                                       (restart, dropped connection) before failing
                                                       (default 60; 0: fail at once)
    CGX_PS_CODEC_THREADS                               codec threads of this process (default 0:
                                                       sized for the host, threads.plan_threads)
    CGX_PS_DATAPLANE                                   how pushes and results travel: auto (the
                                                       shard's raw data plane when it advertises one
                                                       and TLS is off, else gRPC), grpc, or raw
    CGX_PS_QUORUM, CGX_PS_GRACE_MS                     quorum rounds: a block's round closes once this
                                                       many nodes pushed it and the grace (ms, default
                                                       50) passed, without waiting for the rest (0:
                                                       every node); the same on every node
    CGX_PS_TOKEN_FILE                                  the job token the shards require
    CGX_PS_TLS_CA, CGX_PS_TLS_CERT, CGX_PS_TLS_KEY     TLS: the CA of the shards' certificates;
                                                       a client certificate for mutual TLS
    CGX_PS_TLS_SERVER_NAME                             name to check in the shards' certificates
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..net.addresses import check_address, servers_from_env
from ..envparse import Bounds, env_number, plain_number
from ..net.security import ChannelSecurity
from ..quorum_settings import DEFAULT_GRACE_MS, MAX_GRACE_MS, quorum_problem
from .errors import ConfigError

__all__ = ["WorkerConfig", "INTRANODE_TRANSPORTS", "DATAPLANES", "SETTINGS", "dataplane_problem", "node_name"]

INTRANODE_TRANSPORTS = ("auto", "shm", "cuda")
DATAPLANES = ("auto", "grpc", "raw")  # CGX_PS_DATAPLANE (worker/shards/dataplane.py decides with it)


# Every number read from the environment, checked where it is read (envparse.Bounds), so the
# error names the variable the user set, not a value derived from it (RANK from CGX_PS_NUM_NODES).
_MAX_PROCESSES = 1 << 20  # ranks of one job
_MAX_SECONDS = 7 * 86400.0  # a wait of more than a week is a typo
SETTINGS: dict[str, Bounds] = {
    "RANK": Bounds(0, _MAX_PROCESSES - 1), "WORLD_SIZE": Bounds(1, _MAX_PROCESSES),
    "LOCAL_RANK": Bounds(0, _MAX_PROCESSES - 1), "LOCAL_WORLD_SIZE": Bounds(1, _MAX_PROCESSES),
    "GROUP_RANK": Bounds(0, _MAX_PROCESSES - 1), "NODE_RANK": Bounds(0, _MAX_PROCESSES - 1),
    "CGX_PS_NODE_RANK": Bounds(0, _MAX_PROCESSES - 1), "CGX_PS_NUM_NODES": Bounds(1, _MAX_PROCESSES),
    "CGX_PS_CONNECT_TIMEOUT": Bounds(0, _MAX_SECONDS, integer=False, unit="seconds"),
    "CGX_PS_RECOVERY_TIMEOUT": Bounds(0, _MAX_SECONDS, integer=False, unit="seconds"),
    "CGX_PS_INCARNATION": Bounds(0, (1 << 32) - 1), "TORCHELASTIC_RESTART_COUNT": Bounds(0, (1 << 32) - 1),
    "CGX_PS_CODEC_THREADS": Bounds(0, 256),
    "CGX_PS_QUORUM": Bounds(0, _MAX_PROCESSES), "CGX_PS_GRACE_MS": Bounds(0, MAX_GRACE_MS),
}

# Fields set from one variable each, checked as it is when they are built in code.
_FIELD_VARIABLES = {"connect_timeout_s": "CGX_PS_CONNECT_TIMEOUT", "recovery_timeout_s": "CGX_PS_RECOVERY_TIMEOUT",
                    "codec_threads": "CGX_PS_CODEC_THREADS", "incarnation": "CGX_PS_INCARNATION",
                    "quorum": "CGX_PS_QUORUM", "grace_ms": "CGX_PS_GRACE_MS"}


def dataplane_problem(requested: str, tls: bool) -> str | None:
    """Why CGX_PS_DATAPLANE=``requested`` cannot be used by a worker that does (``tls``) or does not
    use TLS; None if it can. The one check behind WorkerConfig, ShardClient and decide_dataplane."""
    if requested not in DATAPLANES:
        return f"CGX_PS_DATAPLANE={requested!r} is not one of {', '.join(DATAPLANES)}"
    if requested == "raw" and tls:
        return "CGX_PS_DATAPLANE=raw with TLS (CGX_PS_TLS_CA): the raw data plane is plaintext; use auto or grpc"
    return None


@dataclass(frozen=True)
class WorkerConfig:
    # this process among all training processes
    rank: int = 0
    world_size: int = 1
    # this process among the processes of its node
    local_rank: int = 0
    local_world_size: int = 1
    # the node among nodes (a node pushes once per block after its ranks reduce locally)
    node_rank: int = 0
    num_nodes: int = 1
    # shard addresses, index = shard index
    servers: tuple[str, ...] = ()
    # how long to retry an unreachable shard at start
    connect_timeout_s: float = 60.0
    # how long to wait for a shard that went away while training (restarted, connection dropped)
    # before failing with ShardUnavailableError; 0 fails at once. A recreated shard pod serves
    # within seconds of its start, its kernels compiling meanwhile (kernels/warm.py): 60 s covers
    # that and the pod's rescheduling
    recovery_timeout_s: float = 60.0
    # the training job, shared by all its workers (lets a shard tell a new job from a restart)
    job_id: str = ""
    # which start of the job (torchrun counts its restarts): a higher one starts a new shard session
    incarnation: int = 0
    # intra-node reduction transport: "auto", "shm" or "cuda"
    intranode: str = "auto"
    # codec threads of this process; 0: the spare cores of the host (threads.plan_threads)
    codec_threads: int = 0
    # how to reach the shards: job token, TLS (docs/security.md)
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    # the Exchange stream's transport: "auto", "grpc" or "raw" (worker/shards/dataplane.py)
    dataplane: str = "auto"
    # quorum rounds (server/rounds/quorum.py): nodes that close a round without the rest (0: all),
    # and how long after the last of them a round still waits for the rest
    quorum: int = 0
    grace_ms: int = DEFAULT_GRACE_MS

    def __post_init__(self) -> None:
        for name, variable in _FIELD_VARIABLES.items():  # as read from the environment, if set in code
            value = getattr(self, name)
            problem = SETTINGS[variable].problem(value)
            if problem:
                raise ConfigError(f"{variable}={plain_number(value)}: {problem}")
        checks = [
            (0 <= self.rank < self.world_size, f"RANK={self.rank} is not in 0..WORLD_SIZE-1={self.world_size - 1}"),
            (0 <= self.local_rank < self.local_world_size,
             f"LOCAL_RANK={self.local_rank} is not in 0..LOCAL_WORLD_SIZE-1={self.local_world_size - 1}"),
            (0 <= self.node_rank < self.num_nodes, f"node rank {self.node_rank} is not below {self.num_nodes} nodes"),
            (self.world_size == self.num_nodes * self.local_world_size,
             f"WORLD_SIZE={self.world_size} != {self.num_nodes} nodes x LOCAL_WORLD_SIZE={self.local_world_size}"),
            (self.intranode in INTRANODE_TRANSPORTS,
             f"CGX_PS_INTRANODE={self.intranode!r} is not one of {', '.join(INTRANODE_TRANSPORTS)}"),
            (dataplane_problem(self.dataplane, self.security.tls) is None,
             dataplane_problem(self.dataplane, self.security.tls) or ""),
            (bool(self.servers), "no shard addresses: set CGX_PS_SERVERS (e.g. 127.0.0.1:7070,127.0.0.1:7071)"),
            (quorum_problem(self.quorum, self.grace_ms, self.num_nodes) is None,
             quorum_problem(self.quorum, self.grace_ms, self.num_nodes) or ""),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        for address in self.servers:
            try:
                check_address(address)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    @property
    def has_quorum(self) -> bool:
        """Whether rounds may close without every node (CGX_PS_QUORUM below the node count)."""
        return 0 < self.quorum < self.num_nodes

    @property
    def node_id(self) -> str:
        return node_name(self.node_rank)

    def member_of(self, rank: int) -> tuple[str, int]:
        """(node id, member) under which a global rank talks to the shards: ranks are numbered
        node by node, LOCAL_WORLD_SIZE per node, as torchrun numbers them."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return f"node-{rank // self.local_world_size}", rank % self.local_world_size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "WorkerConfig":
        env = os.environ if env is None else env

        def num(name: str, default: float) -> Any:
            return env_number(env, name, default, SETTINGS[name], error=ConfigError)

        local_rank, local_size = num("LOCAL_RANK", 0), num("LOCAL_WORLD_SIZE", 1)
        if "CGX_PS_NODE_RANK" in env or "CGX_PS_NUM_NODES" in env:
            # torchrun --standalone on every node: its RANK/WORLD_SIZE are node-local
            node_rank, num_nodes = num("CGX_PS_NODE_RANK", 0), num("CGX_PS_NUM_NODES", 1)
            if node_rank >= num_nodes:
                raise ConfigError(f"CGX_PS_NODE_RANK={node_rank} must be below CGX_PS_NUM_NODES={num_nodes} "
                                  f"(node ranks are 0..{num_nodes - 1})")
            rank, world = node_rank * local_size + local_rank, num_nodes * local_size
        else:
            rank, world = num("RANK", 0), num("WORLD_SIZE", 1)
            node_rank = num("GROUP_RANK", num("NODE_RANK", rank // max(local_size, 1)))
            num_nodes = max(1, world // max(local_size, 1))
        try:
            security = ChannelSecurity.from_env(env)
            security.check()  # a missing or malformed file fails here, named
            servers = tuple(overrides["servers"]) if "servers" in overrides else servers_from_env(env)
        except ValueError as exc:  # CredentialError is one
            raise ConfigError(str(exc)) from None
        config = cls(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_size,
                     node_rank=node_rank, num_nodes=num_nodes,
                     servers=servers,
                     connect_timeout_s=num("CGX_PS_CONNECT_TIMEOUT", 60.0),
                     recovery_timeout_s=num("CGX_PS_RECOVERY_TIMEOUT", 60.0),
                     job_id=env.get("CGX_PS_JOB_ID", ""),
                     incarnation=num("CGX_PS_INCARNATION", num("TORCHELASTIC_RESTART_COUNT", 0)),
                     intranode=env.get("CGX_PS_INTRANODE", "auto").strip().lower() or "auto",
                     codec_threads=num("CGX_PS_CODEC_THREADS", 0),
                     dataplane=env.get("CGX_PS_DATAPLANE", "auto").strip().lower() or "auto",
                     quorum=num("CGX_PS_QUORUM", 0), grace_ms=num("CGX_PS_GRACE_MS", DEFAULT_GRACE_MS),
                     security=security)
        return replace(config, **overrides) if overrides else config


def node_name(node_rank: int) -> str:
    """The id under which node ``node_rank`` registers with the shards."""
    return f"node-{node_rank}"
