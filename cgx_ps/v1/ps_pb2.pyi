from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_MAXMIN: _ClassVar[Codec]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_NONE: _ClassVar[SessionState]
    SESSION_STATE_ACTIVE: _ClassVar[SessionState]
    SESSION_STATE_IDLE: _ClassVar[SessionState]
    SESSION_STATE_FAILED: _ClassVar[SessionState]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_MAXMIN: Codec
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_NONE: SessionState
SESSION_STATE_ACTIVE: SessionState
SESSION_STATE_IDLE: SessionState
SESSION_STATE_FAILED: SessionState

class CodecSettings(_message.Message):
    __slots__ = ("codec", "bits", "bucket_size", "stochastic")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZE_FIELD_NUMBER: _ClassVar[int]
    STOCHASTIC_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    bits: int
    bucket_size: int
    stochastic: bool
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., bits: _Optional[int] = ..., bucket_size: _Optional[int] = ..., stochastic: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "codec", "allow_non_finite")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    codec: CodecSettings
    allow_non_finite: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ..., allow_non_finite: _Optional[bool] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("tensor_index", "offset", "numel")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    numel: int
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class BlockSpec(_message.Message):
    __slots__ = ("block_id", "shard", "numel", "codec", "segments")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    shard: int
    numel: int
    codec: CodecSettings
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, block_id: _Optional[int] = ..., shard: _Optional[int] = ..., numel: _Optional[int] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("tensors", "blocks", "num_shards")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSpec]
    num_shards: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., blocks: _Optional[_Iterable[_Union[BlockSpec, _Mapping]]] = ..., num_shards: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "num_nodes", "layout", "layout_hash", "client_version", "job_id", "member", "resume", "incarnation", "quorum", "grace_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    num_nodes: int
    layout: Layout
    layout_hash: str
    client_version: str
    job_id: str
    member: int
    resume: bool
    incarnation: int
    quorum: int
    grace_ms: int
    def __init__(self, node_id: _Optional[str] = ..., num_nodes: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., layout_hash: _Optional[str] = ..., client_version: _Optional[str] = ..., job_id: _Optional[str] = ..., member: _Optional[int] = ..., resume: _Optional[bool] = ..., incarnation: _Optional[int] = ..., quorum: _Optional[int] = ..., grace_ms: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "block_ids", "next_rounds", "server_version", "round_timeout_s", "session_id", "instance_id", "incarnation", "data_port")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    next_rounds: _containers.RepeatedScalarFieldContainer[int]
    server_version: str
    round_timeout_s: float
    session_id: str
    instance_id: str
    incarnation: int
    data_port: int
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., next_rounds: _Optional[_Iterable[int]] = ..., server_version: _Optional[str] = ..., round_timeout_s: _Optional[float] = ..., session_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("hello", "push")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    push: PushChunk
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., push: _Optional[_Union[PushChunk, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "layout_hash", "member", "session_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    layout_hash: str
    member: int
    session_id: str
    def __init__(self, node_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., member: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("round", "block_id", "total_bytes", "offset", "data", "restore", "fetch", "out_of_data")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_DATA_FIELD_NUMBER: _ClassVar[int]
    round: int
    block_id: int
    total_bytes: int
    offset: int
    data: bytes
    restore: bool
    fetch: bool
    out_of_data: bool
    def __init__(self, round: _Optional[int] = ..., block_id: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., restore: _Optional[bool] = ..., fetch: _Optional[bool] = ..., out_of_data: _Optional[bool] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("pull", "error", "late", "everyone_left")
    PULL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    EVERYONE_LEFT_FIELD_NUMBER: _ClassVar[int]
    pull: PullChunk
    error: RoundError
    late: LateNotice
    everyone_left: EveryoneLeft
    def __init__(self, pull: _Optional[_Union[PullChunk, _Mapping]] = ..., error: _Optional[_Union[RoundError, _Mapping]] = ..., late: _Optional[_Union[LateNotice, _Mapping]] = ..., everyone_left: _Optional[_Union[EveryoneLeft, _Mapping]] = ...) -> None: ...

class EveryoneLeft(_message.Message):
    __slots__ = ("round", "block_id")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    round: int
    block_id: int
    def __init__(self, round: _Optional[int] = ..., block_id: _Optional[int] = ...) -> None: ...

class LateNotice(_message.Message):
    __slots__ = ("round", "block_id", "next_round")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    block_id: int
    next_round: int
    def __init__(self, round: _Optional[int] = ..., block_id: _Optional[int] = ..., next_round: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("round", "block_id", "total_bytes", "offset", "data")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    round: int
    block_id: int
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, round: _Optional[int] = ..., block_id: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RoundError(_message.Message):
    __slots__ = ("round", "block_id", "message", "missing_nodes")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MISSING_NODES_FIELD_NUMBER: _ClassVar[int]
    round: int
    block_id: int
    message: str
    missing_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., block_id: _Optional[int] = ..., message: _Optional[str] = ..., missing_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("key", "total_bytes", "offset", "data", "node_id", "member", "session_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    total_bytes: int
    offset: int
    data: bytes
    node_id: str
    member: int
    session_id: str
    def __init__(self, key: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., node_id: _Optional[str] = ..., member: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class PutBlobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBlobRequest(_message.Message):
    __slots__ = ("key", "timeout_s", "session_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_s: float
    session_id: str
    def __init__(self, key: _Optional[str] = ..., timeout_s: _Optional[float] = ..., session_id: _Optional[str] = ...) -> None: ...

class BlockCodec(_message.Message):
    __slots__ = ("block_id", "codec")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    codec: CodecSettings
    def __init__(self, block_id: _Optional[int] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ...) -> None: ...

class SetCodecsRequest(_message.Message):
    __slots__ = ("node_id", "from_round", "blocks", "session_id", "resume")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    from_round: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockCodec]
    session_id: str
    resume: bool
    def __init__(self, node_id: _Optional[str] = ..., from_round: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockCodec, _Mapping]]] = ..., session_id: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class SetCodecsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProbeChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "server_version", "instance_id", "uptime_s", "draining", "session_state", "job_id", "num_nodes", "nodes_registered", "members_registered", "streams_open", "blocks_owned", "rounds_completed", "idle_s", "rounds_total", "rounds_failed", "bytes_in", "bytes_out", "pushes_rejected", "inflight_bytes", "max_inflight_bytes", "last_error", "last_error_age_s", "data_port", "quorum", "grace_ms", "late_nodes", "late_pushes")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SESSION_STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NODES_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_OPEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_OWNED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_AGE_S_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    LATE_NODES_FIELD_NUMBER: _ClassVar[int]
    LATE_PUSHES_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    server_version: str
    instance_id: str
    uptime_s: float
    draining: bool
    session_state: SessionState
    job_id: str
    num_nodes: int
    nodes_registered: int
    members_registered: int
    streams_open: int
    blocks_owned: int
    rounds_completed: int
    idle_s: float
    rounds_total: int
    rounds_failed: int
    bytes_in: int
    bytes_out: int
    pushes_rejected: int
    inflight_bytes: int
    max_inflight_bytes: int
    last_error: str
    last_error_age_s: float
    data_port: int
    quorum: int
    grace_ms: int
    late_nodes: _containers.RepeatedScalarFieldContainer[str]
    late_pushes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., server_version: _Optional[str] = ..., instance_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., draining: _Optional[bool] = ..., session_state: _Optional[_Union[SessionState, str]] = ..., job_id: _Optional[str] = ..., num_nodes: _Optional[int] = ..., nodes_registered: _Optional[int] = ..., members_registered: _Optional[int] = ..., streams_open: _Optional[int] = ..., blocks_owned: _Optional[int] = ..., rounds_completed: _Optional[int] = ..., idle_s: _Optional[float] = ..., rounds_total: _Optional[int] = ..., rounds_failed: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., inflight_bytes: _Optional[int] = ..., max_inflight_bytes: _Optional[int] = ..., last_error: _Optional[str] = ..., last_error_age_s: _Optional[float] = ..., data_port: _Optional[int] = ..., quorum: _Optional[int] = ..., grace_ms: _Optional[int] = ..., late_nodes: _Optional[_Iterable[str]] = ..., late_pushes: _Optional[_Iterable[int]] = ...) -> None: ...
