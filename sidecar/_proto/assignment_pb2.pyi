from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AssignRequest(_message.Message):
    __slots__ = ("experiment", "sticky_value", "unix_time")
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    STICKY_VALUE_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    experiment: str
    sticky_value: str
    unix_time: float
    def __init__(self, experiment: _Optional[str] = ..., sticky_value: _Optional[str] = ..., unix_time: _Optional[float] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("experiment", "client_model", "variant_id", "variant_model", "sticky", "window", "next_boundary", "scores", "unix_time", "sticky_ttl", "sticky_key", "algorithm")
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    VARIANT_MODEL_FIELD_NUMBER: _ClassVar[int]
    STICKY_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NEXT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    STICKY_TTL_FIELD_NUMBER: _ClassVar[int]
    STICKY_KEY_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    experiment: str
    client_model: str
    variant_id: str
    variant_model: str
    sticky: bool
    window: int
    next_boundary: float
    scores: _containers.RepeatedCompositeFieldContainer[VariantScore]
    unix_time: float
    sticky_ttl: int
    sticky_key: str
    algorithm: str
    def __init__(self, experiment: _Optional[str] = ..., client_model: _Optional[str] = ..., variant_id: _Optional[str] = ..., variant_model: _Optional[str] = ..., sticky: _Optional[bool] = ..., window: _Optional[int] = ..., next_boundary: _Optional[float] = ..., scores: _Optional[_Iterable[_Union[VariantScore, _Mapping]]] = ..., unix_time: _Optional[float] = ..., sticky_ttl: _Optional[int] = ..., sticky_key: _Optional[str] = ..., algorithm: _Optional[str] = ...) -> None: ...

class VariantScore(_message.Message):
    __slots__ = ("variant_id", "weight", "u", "score", "model")
    VARIANT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    U_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    variant_id: str
    weight: int
    u: float
    score: float
    model: str
    def __init__(self, variant_id: _Optional[str] = ..., weight: _Optional[int] = ..., u: _Optional[float] = ..., score: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...
