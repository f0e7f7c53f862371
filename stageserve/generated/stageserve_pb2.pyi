from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_NONE: _ClassVar[FailureReason]
    INVALID_INPUT: _ClassVar[FailureReason]
    MODEL_NOT_FOUND: _ClassVar[FailureReason]
    STAGE_UNAVAILABLE: _ClassVar[FailureReason]
    NO_INSTANCE: _ClassVar[FailureReason]
    INSTANCE_BUSY: _ClassVar[FailureReason]
    QUEUE_REJECTED: _ClassVar[FailureReason]
    RESOURCE_EXHAUSTED: _ClassVar[FailureReason]
    BACKEND_FAILED: _ClassVar[FailureReason]
    LOAD_FAILED: _ClassVar[FailureReason]
    CANCELLED: _ClassVar[FailureReason]
    ALREADY_EXISTS: _ClassVar[FailureReason]
    UNIMPLEMENTED: _ClassVar[FailureReason]
    DEADLINE_EXCEEDED: _ClassVar[FailureReason]
    UNKNOWN_FAILURE: _ClassVar[FailureReason]
    STAGE_FAULT: _ClassVar[FailureReason]
    NOT_OWNER: _ClassVar[FailureReason]
    TENSOR_REGION_NOT_LOCAL: _ClassVar[FailureReason]
FAILURE_NONE: FailureReason
INVALID_INPUT: FailureReason
MODEL_NOT_FOUND: FailureReason
STAGE_UNAVAILABLE: FailureReason
NO_INSTANCE: FailureReason
INSTANCE_BUSY: FailureReason
QUEUE_REJECTED: FailureReason
RESOURCE_EXHAUSTED: FailureReason
BACKEND_FAILED: FailureReason
LOAD_FAILED: FailureReason
CANCELLED: FailureReason
ALREADY_EXISTS: FailureReason
UNIMPLEMENTED: FailureReason
DEADLINE_EXCEEDED: FailureReason
UNKNOWN_FAILURE: FailureReason
STAGE_FAULT: FailureReason
NOT_OWNER: FailureReason
TENSOR_REGION_NOT_LOCAL: FailureReason

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw", "parts", "device_written")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    parts: _containers.RepeatedCompositeFieldContainer[TensorPart]
    device_written: bool
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ..., parts: _Optional[_Iterable[_Union[TensorPart, _Mapping]]] = ..., device_written: _Optional[bool] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("region", "offset", "length", "raw", "generation", "cuda")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    length: int
    raw: bytes
    generation: int
    cuda: CudaExtent
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., raw: _Optional[bytes] = ..., generation: _Optional[int] = ..., cuda: _Optional[_Union[CudaExtent, _Mapping]] = ...) -> None: ...

class CudaExtent(_message.Message):
    __slots__ = ("raw_handle", "offset", "byte_size", "device_id")
    RAW_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    raw_handle: bytes
    offset: int
    byte_size: int
    device_id: int
    def __init__(self, raw_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class CudaOutput(_message.Message):
    __slots__ = ("name", "extent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXTENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    extent: CudaExtent
    def __init__(self, name: _Optional[str] = ..., extent: _Optional[_Union[CudaExtent, _Mapping]] = ...) -> None: ...

class CudaOutputs(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[CudaOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[CudaOutput, _Mapping]]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ns", "compute_input_ns", "compute_infer_ns", "compute_output_ns", "batch_size", "batch_leader", "enqueue_ns", "execute_end_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_NS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_LEADER_FIELD_NUMBER: _ClassVar[int]
    ENQUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_END_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    batch_size: int
    batch_leader: bool
    enqueue_ns: int
    execute_end_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., compute_input_ns: _Optional[int] = ..., compute_infer_ns: _Optional[int] = ..., compute_output_ns: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_leader: _Optional[bool] = ..., enqueue_ns: _Optional[int] = ..., execute_end_ns: _Optional[int] = ...) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("id", "model", "version", "inputs", "outputs", "batch_size", "priority", "timeout_us", "config_generation", "sequence_id", "sequence_id_str", "sequence_start", "sequence_end", "request_id", "parameters_json", "traceparent", "shm_host", "shm_pid", "cuda_outputs")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    CONFIG_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_STR_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_START_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_END_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_FIELD_NUMBER: _ClassVar[int]
    SHM_PID_FIELD_NUMBER: _ClassVar[int]
    CUDA_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    id: int
    model: str
    version: int
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    batch_size: int
    priority: int
    timeout_us: int
    config_generation: int
    sequence_id: int
    sequence_id_str: str
    sequence_start: bool
    sequence_end: bool
    request_id: str
    parameters_json: str
    traceparent: str
    shm_host: str
    shm_pid: int
    cuda_outputs: _containers.RepeatedCompositeFieldContainer[CudaOutput]
    def __init__(self, id: _Optional[int] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., batch_size: _Optional[int] = ..., priority: _Optional[int] = ..., timeout_us: _Optional[int] = ..., config_generation: _Optional[int] = ..., sequence_id: _Optional[int] = ..., sequence_id_str: _Optional[str] = ..., sequence_start: _Optional[bool] = ..., sequence_end: _Optional[bool] = ..., request_id: _Optional[str] = ..., parameters_json: _Optional[str] = ..., traceparent: _Optional[str] = ..., shm_host: _Optional[str] = ..., shm_pid: _Optional[int] = ..., cuda_outputs: _Optional[_Iterable[_Union[CudaOutput, _Mapping]]] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("id", "failure", "message", "outputs", "timing", "steps", "more", "no_response", "model_error")
    ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    NO_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    failure: FailureReason
    message: str
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    timing: Timing
    steps: _containers.RepeatedCompositeFieldContainer[StepStat]
    more: bool
    no_response: bool
    model_error: bool
    def __init__(self, id: _Optional[int] = ..., failure: _Optional[_Union[FailureReason, str]] = ..., message: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[StepStat, _Mapping]]] = ..., more: _Optional[bool] = ..., no_response: _Optional[bool] = ..., model_error: _Optional[bool] = ...) -> None: ...

class StepStat(_message.Message):
    __slots__ = ("model", "version", "timing", "batch_size", "duration_ns", "failure", "message", "model_error", "start_ns", "cache_hit", "cache_miss", "cache_ns")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DURATION_NS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ERROR_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    timing: Timing
    batch_size: int
    duration_ns: int
    failure: FailureReason
    message: str
    model_error: bool
    start_ns: int
    cache_hit: bool
    cache_miss: bool
    cache_ns: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., batch_size: _Optional[int] = ..., duration_ns: _Optional[int] = ..., failure: _Optional[_Union[FailureReason, str]] = ..., message: _Optional[str] = ..., model_error: _Optional[bool] = ..., start_ns: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., cache_miss: _Optional[bool] = ..., cache_ns: _Optional[int] = ...) -> None: ...

class ScheduleBatch(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScheduleRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScheduleRequest, _Mapping]]] = ...) -> None: ...

class ScheduleResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScheduleResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScheduleResponse, _Mapping]]] = ...) -> None: ...

class QueueStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelQueueStats(_message.Message):
    __slots__ = ("model", "version", "pending", "executing_batches")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    EXECUTING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    pending: int
    executing_batches: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., pending: _Optional[int] = ..., executing_batches: _Optional[int] = ...) -> None: ...

class QueueStatsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelQueueStats]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelQueueStats, _Mapping]]] = ...) -> None: ...

class ResourceNeed(_message.Message):
    __slots__ = ("name", "count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., **kwargs) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "model", "version", "kind", "device_id", "worker_id", "worker_address", "priority", "resources")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    version: int
    kind: str
    device_id: int
    worker_id: str
    worker_address: str
    priority: int
    resources: _containers.RepeatedCompositeFieldContainer[ResourceNeed]
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., kind: _Optional[str] = ..., device_id: _Optional[int] = ..., worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., priority: _Optional[int] = ..., resources: _Optional[_Iterable[_Union[ResourceNeed, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "worker_address", "instances", "lease_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_address: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    lease_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., worker_address: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "lease_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("model", "version", "wait_ms", "lease_ms", "traceparents", "only_instances", "other_than", "holder")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    ONLY_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    OTHER_THAN_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    wait_ms: int
    lease_ms: int
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    only_instances: _containers.RepeatedScalarFieldContainer[str]
    other_than: _containers.RepeatedScalarFieldContainer[str]
    holder: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., wait_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ..., traceparents: _Optional[_Iterable[str]] = ..., only_instances: _Optional[_Iterable[str]] = ..., other_than: _Optional[_Iterable[str]] = ..., holder: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("granted", "grant_id", "instance", "reason", "holds_resources", "failure", "gone_instances")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOLDS_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    GONE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    grant_id: str
    instance: InstanceInfo
    reason: str
    holds_resources: bool
    failure: FailureReason
    gone_instances: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, granted: _Optional[bool] = ..., grant_id: _Optional[str] = ..., instance: _Optional[_Union[InstanceInfo, _Mapping]] = ..., reason: _Optional[str] = ..., holds_resources: _Optional[bool] = ..., failure: _Optional[_Union[FailureReason, str]] = ..., gone_instances: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("grant_id", "instance_failed", "reason")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FAILED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    instance_failed: bool
    reason: str
    def __init__(self, grant_id: _Optional[str] = ..., instance_failed: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("id", "acquire", "release")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    id: int
    acquire: AcquireRequest
    release: ReleaseRequest
    def __init__(self, id: _Optional[int] = ..., acquire: _Optional[_Union[AcquireRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class GrantRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GrantRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GrantRequest, _Mapping]]] = ...) -> None: ...

class GrantResponse(_message.Message):
    __slots__ = ("id", "more", "acquire", "failure", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    more: bool
    acquire: AcquireResponse
    failure: FailureReason
    message: str
    def __init__(self, id: _Optional[int] = ..., more: _Optional[bool] = ..., acquire: _Optional[_Union[AcquireResponse, _Mapping]] = ..., failure: _Optional[_Union[FailureReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class GrantResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GrantResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[GrantResponse, _Mapping]]] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("grant_ids", "lease_ms")
    GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    grant_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_ms: int
    def __init__(self, grant_ids: _Optional[_Iterable[str]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lost_grant_ids",)
    LOST_GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    lost_grant_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lost_grant_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseHolderRequest(_message.Message):
    __slots__ = ("holder",)
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    holder: str
    def __init__(self, holder: _Optional[str] = ...) -> None: ...

class ReleaseHolderResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "busy_instance_ids")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    BUSY_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    busy_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., busy_instance_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestedOutputs(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestOutputs(_message.Message):
    __slots__ = ("outputs", "failure", "message")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    failure: FailureReason
    message: str
    def __init__(self, outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., failure: _Optional[_Union[FailureReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "correlation_id", "correlation_id_str", "flags", "parameters_json", "padding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_ID_STR_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    correlation_id: int
    correlation_id_str: str
    flags: int
    parameters_json: str
    padding: bool
    def __init__(self, request_id: _Optional[str] = ..., correlation_id: _Optional[int] = ..., correlation_id_str: _Optional[str] = ..., flags: _Optional[int] = ..., parameters_json: _Optional[str] = ..., padding: _Optional[bool] = ...) -> None: ...

class DecoupledPart(_message.Message):
    __slots__ = ("request_index", "has_response", "response", "final", "compute_infer_ns")
    REQUEST_INDEX_FIELD_NUMBER: _ClassVar[int]
    HAS_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_NS_FIELD_NUMBER: _ClassVar[int]
    request_index: int
    has_response: bool
    response: RequestOutputs
    final: bool
    compute_infer_ns: int
    def __init__(self, request_index: _Optional[int] = ..., has_response: _Optional[bool] = ..., response: _Optional[_Union[RequestOutputs, _Mapping]] = ..., final: _Optional[bool] = ..., compute_infer_ns: _Optional[int] = ...) -> None: ...

class RaggedShapes(_message.Message):
    __slots__ = ("input", "rank", "dims")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    input: str
    rank: int
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, input: _Optional[str] = ..., rank: _Optional[int] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("id", "instance_id", "inputs", "request_batch_sizes", "requested", "ragged_shapes", "request_info", "traceparents", "shm_hosts", "shm_pids", "cuda_outputs")
    ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    RAGGED_SHAPES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_INFO_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    SHM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    SHM_PIDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    id: int
    instance_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    request_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    requested: _containers.RepeatedCompositeFieldContainer[RequestedOutputs]
    ragged_shapes: _containers.RepeatedCompositeFieldContainer[RaggedShapes]
    request_info: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    shm_hosts: _containers.RepeatedScalarFieldContainer[str]
    shm_pids: _containers.RepeatedScalarFieldContainer[int]
    cuda_outputs: _containers.RepeatedCompositeFieldContainer[CudaOutputs]
    def __init__(self, id: _Optional[int] = ..., instance_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., request_batch_sizes: _Optional[_Iterable[int]] = ..., requested: _Optional[_Iterable[_Union[RequestedOutputs, _Mapping]]] = ..., ragged_shapes: _Optional[_Iterable[_Union[RaggedShapes, _Mapping]]] = ..., request_info: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ..., traceparents: _Optional[_Iterable[str]] = ..., shm_hosts: _Optional[_Iterable[str]] = ..., shm_pids: _Optional[_Iterable[int]] = ..., cuda_outputs: _Optional[_Iterable[_Union[CudaOutputs, _Mapping]]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("id", "failure", "message", "results", "compute_input_ns", "compute_infer_ns", "compute_output_ns", "parts", "more", "execute_returned")
    ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_NS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_RETURNED_FIELD_NUMBER: _ClassVar[int]
    id: int
    failure: FailureReason
    message: str
    results: _containers.RepeatedCompositeFieldContainer[RequestOutputs]
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    parts: _containers.RepeatedCompositeFieldContainer[DecoupledPart]
    more: bool
    execute_returned: bool
    def __init__(self, id: _Optional[int] = ..., failure: _Optional[_Union[FailureReason, str]] = ..., message: _Optional[str] = ..., results: _Optional[_Iterable[_Union[RequestOutputs, _Mapping]]] = ..., compute_input_ns: _Optional[int] = ..., compute_infer_ns: _Optional[int] = ..., compute_output_ns: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[DecoupledPart, _Mapping]]] = ..., more: _Optional[bool] = ..., execute_returned: _Optional[bool] = ...) -> None: ...

class ExecuteRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ExecuteRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ExecuteRequest, _Mapping]]] = ...) -> None: ...

class ExecuteResponses(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ExecuteResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ExecuteResponse, _Mapping]]] = ...) -> None: ...
