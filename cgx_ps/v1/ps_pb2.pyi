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
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_MAXMIN: Codec

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
    __slots__ = ("name", "shape", "dtype", "codec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    codec: CodecSettings
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("node_id", "num_nodes", "layout", "layout_hash", "client_version", "job_id", "member")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    num_nodes: int
    layout: Layout
    layout_hash: str
    client_version: str
    job_id: str
    member: int
    def __init__(self, node_id: _Optional[str] = ..., num_nodes: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., layout_hash: _Optional[str] = ..., client_version: _Optional[str] = ..., job_id: _Optional[str] = ..., member: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "block_ids", "next_rounds", "server_version", "round_timeout_s", "session_id", "instance_id")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    next_rounds: _containers.RepeatedScalarFieldContainer[int]
    server_version: str
    round_timeout_s: float
    session_id: str
    instance_id: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., next_rounds: _Optional[_Iterable[int]] = ..., server_version: _Optional[str] = ..., round_timeout_s: _Optional[float] = ..., session_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

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

class ExchangeResponse(_message.Message):
    __slots__ = ("pull", "error")
    PULL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    pull: PullChunk
    error: RoundError
    def __init__(self, pull: _Optional[_Union[PullChunk, _Mapping]] = ..., error: _Optional[_Union[RoundError, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("node_id", "from_round", "blocks", "session_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    from_round: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockCodec]
    session_id: str
    def __init__(self, node_id: _Optional[str] = ..., from_round: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockCodec, _Mapping]]] = ..., session_id: _Optional[str] = ...) -> None: ...

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
