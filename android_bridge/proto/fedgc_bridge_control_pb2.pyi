# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ControlTask(_message.Message):
    __slots__ = ("fields_json", "blobs", "timeout_s")
    class BlobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    fields_json: str
    blobs: _containers.ScalarMap[str, bytes]
    timeout_s: float
    def __init__(self, fields_json: _Optional[str] = ..., blobs: _Optional[_Mapping[str, bytes]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ControlResult(_message.Message):
    __slots__ = ("task_id", "upload_id", "update_bytes", "side_bytes", "metrics_json", "side_entries")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_JSON_FIELD_NUMBER: _ClassVar[int]
    SIDE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    upload_id: str
    update_bytes: bytes
    side_bytes: bytes
    metrics_json: str
    side_entries: int
    def __init__(self, task_id: _Optional[str] = ..., upload_id: _Optional[str] = ..., update_bytes: _Optional[bytes] = ..., side_bytes: _Optional[bytes] = ..., metrics_json: _Optional[str] = ..., side_entries: _Optional[int] = ...) -> None: ...
