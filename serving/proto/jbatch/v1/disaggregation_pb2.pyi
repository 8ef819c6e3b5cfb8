from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArraySpec(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class HandoverRequest(_message.Message):
    __slots__ = ("request_id", "transfer_address", "transfer_uuid", "num_pages", "arrays", "record_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_UUID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_address: str
    transfer_uuid: int
    num_pages: int
    arrays: _containers.RepeatedCompositeFieldContainer[ArraySpec]
    record_json: bytes
    def __init__(self, request_id: _Optional[str] = ..., transfer_address: _Optional[str] = ..., transfer_uuid: _Optional[int] = ..., num_pages: _Optional[int] = ..., arrays: _Optional[_Iterable[_Union[ArraySpec, _Mapping]]] = ..., record_json: _Optional[bytes] = ...) -> None: ...

class HandoverOutput(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stop_token_id", "stop_string", "completion_tokens", "top_logprobs_json", "prompt_logprobs_json")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stop_token_id: int
    stop_string: str
    completion_tokens: int
    top_logprobs_json: bytes
    prompt_logprobs_json: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., top_logprobs_json: _Optional[bytes] = ..., prompt_logprobs_json: _Optional[bytes] = ...) -> None: ...

class PoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatusResponse(_message.Message):
    __slots__ = ("free_pages", "total_pages", "running", "waiting")
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    free_pages: int
    total_pages: int
    running: int
    waiting: int
    def __init__(self, free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...
