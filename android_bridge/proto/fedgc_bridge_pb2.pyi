# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_ENCODING_UNSPECIFIED: _ClassVar[ModelEncoding]
    DENSE: _ClassVar[ModelEncoding]
    SPARSE_PATCH: _ClassVar[ModelEncoding]

class UpdateState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_STATE_UNSPECIFIED: _ClassVar[UpdateState]
    INCOMPLETE: _ClassVar[UpdateState]
    DELIVERED: _ClassVar[UpdateState]
    REJECTED: _ClassVar[UpdateState]
    MISSED_ROUND: _ClassVar[UpdateState]
MODEL_ENCODING_UNSPECIFIED: ModelEncoding
DENSE: ModelEncoding
SPARSE_PATCH: ModelEncoding
UPDATE_STATE_UNSPECIFIED: UpdateState
INCOMPLETE: UpdateState
DELIVERED: UpdateState
REJECTED: UpdateState
MISSED_ROUND: UpdateState

class RegisterRequest(_message.Message):
    __slots__ = ("device_id", "token", "manifest_sha256")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    token: str
    manifest_sha256: str
    def __init__(self, device_id: _Optional[str] = ..., token: _Optional[str] = ..., manifest_sha256: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("session_id", "poll_interval_s", "max_wait_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    poll_interval_s: float
    max_wait_s: float
    def __init__(self, session_id: _Optional[str] = ..., poll_interval_s: _Optional[float] = ..., max_wait_s: _Optional[float] = ...) -> None: ...

class FetchTaskRequest(_message.Message):
    __slots__ = ("session_id", "held_model_version", "wait_s", "held_config_sha256", "initial_model_sha256")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    HELD_CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    INITIAL_MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    held_model_version: int
    wait_s: float
    held_config_sha256: str
    initial_model_sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., held_model_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., held_config_sha256: _Optional[str] = ..., initial_model_sha256: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchTaskReply(_message.Message):
    __slots__ = ("has_task", "task_id", "server_round", "model_version", "encoding", "base_version", "model_bytes", "config_json", "ack_sequence", "sequence", "max_chunk_bytes", "max_update_bytes", "config_sha256", "base_sha256", "shared_mask", "initial_sha256", "patch_context")
    HAS_TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ACK_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_UPDATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    SHARED_MASK_FIELD_NUMBER: _ClassVar[int]
    INITIAL_SHA256_FIELD_NUMBER: _ClassVar[int]
    PATCH_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    has_task: bool
    task_id: str
    server_round: int
    model_version: int
    encoding: ModelEncoding
    base_version: int
    model_bytes: bytes
    config_json: str
    ack_sequence: int
    sequence: int
    max_chunk_bytes: int
    max_update_bytes: int
    config_sha256: str
    base_sha256: str
    shared_mask: bytes
    initial_sha256: str
    patch_context: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, has_task: _Optional[bool] = ..., task_id: _Optional[str] = ..., server_round: _Optional[int] = ..., model_version: _Optional[int] = ..., encoding: _Optional[_Union[ModelEncoding, str]] = ..., base_version: _Optional[int] = ..., model_bytes: _Optional[bytes] = ..., config_json: _Optional[str] = ..., ack_sequence: _Optional[int] = ..., sequence: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., max_update_bytes: _Optional[int] = ..., config_sha256: _Optional[str] = ..., base_sha256: _Optional[str] = ..., shared_mask: _Optional[bytes] = ..., initial_sha256: _Optional[str] = ..., patch_context: _Optional[_Iterable[str]] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("session_id", "task_id", "upload_id", "offset", "data", "total_bytes", "sha256", "metrics_json", "side_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    SIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task_id: str
    upload_id: str
    offset: int
    data: bytes
    total_bytes: int
    sha256: str
    metrics_json: str
    side_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., task_id: _Optional[str] = ..., upload_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., metrics_json: _Optional[str] = ..., side_bytes: _Optional[int] = ...) -> None: ...

class QueryUploadRequest(_message.Message):
    __slots__ = ("session_id", "upload_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    upload_id: str
    def __init__(self, session_id: _Optional[str] = ..., upload_id: _Optional[str] = ...) -> None: ...

class UploadStatus(_message.Message):
    __slots__ = ("upload_id", "received_bytes", "total_bytes", "complete", "state", "detail")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    received_bytes: int
    total_bytes: int
    complete: bool
    state: UpdateState
    detail: str
    def __init__(self, upload_id: _Optional[str] = ..., received_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., complete: _Optional[bool] = ..., state: _Optional[_Union[UpdateState, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("session_id", "upload_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    upload_id: str
    def __init__(self, session_id: _Optional[str] = ..., upload_id: _Optional[str] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ("state", "detail", "last_aggregated_sequence")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LAST_AGGREGATED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    state: UpdateState
    detail: str
    last_aggregated_sequence: int
    def __init__(self, state: _Optional[_Union[UpdateState, str]] = ..., detail: _Optional[str] = ..., last_aggregated_sequence: _Optional[int] = ...) -> None: ...
