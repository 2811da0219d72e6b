from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "transfer_token", "endpoint", "layout", "lease_ms", "max_chunk_bytes", "cache_shm_name", "cache_num_blocks", "node")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_token: str
    endpoint: str
    layout: KVLayout
    lease_ms: int
    max_chunk_bytes: int
    cache_shm_name: str
    cache_num_blocks: int
    node: str
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., transfer_token: _Optional[str] = ..., endpoint: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., lease_ms: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., cache_shm_name: _Optional[str] = ..., cache_num_blocks: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("request_id", "transfer_token", "holder")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: str
    holder: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVChunkHeader(_message.Message):
    __slots__ = ("request_id", "transfer_token", "layer_start", "layer_end", "block_ids", "dtype", "shape", "checksum", "payload_bytes", "transport", "shm_offset", "shm_name", "commit", "num_tokens", "collective_seq")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: str
    layer_start: int
    layer_end: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: int
    payload_bytes: int
    transport: str
    shm_offset: int
    shm_name: str
    commit: bool
    num_tokens: int
    collective_seq: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_name: _Optional[str] = ..., commit: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., collective_seq: _Optional[int] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("bytes", "seconds", "chunks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    chunks: int
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., chunks: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "transfer_token", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_token: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_token: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
