import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from stagediff.v1 import image_pb2 as _image_pb2
from stagediff.v1 import stages_pb2 as _stages_pb2
from stagediff.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class InterpolationParams(_message.Message):
    __slots__ = ("enable", "exp", "scale", "model_path")
    ENABLE_FIELD_NUMBER: _ClassVar[int]
    EXP_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    enable: bool
    exp: int
    scale: float
    model_path: str
    def __init__(self, enable: _Optional[bool] = ..., exp: _Optional[int] = ..., scale: _Optional[float] = ..., model_path: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale", "seed", "fps", "interpolation", "request_id", "images", "cache", "loras", "output_format", "output_quality", "keep_raw_frames", "notices", "embedded_guidance_scale", "audio_codec", "deadline_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    INTERPOLATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_QUALITY_FIELD_NUMBER: _ClassVar[int]
    KEEP_RAW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CODEC_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    fps: float
    interpolation: InterpolationParams
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_image_pb2.InputImage]
    cache: _stages_pb2.StepCache
    loras: _containers.RepeatedCompositeFieldContainer[_stages_pb2.LoraAdapter]
    output_format: str
    output_quality: int
    keep_raw_frames: bool
    notices: _containers.RepeatedCompositeFieldContainer[_stages_pb2.Notice]
    embedded_guidance_scale: float
    audio_codec: str
    deadline_s: float
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_frames: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., fps: _Optional[float] = ..., interpolation: _Optional[_Union[InterpolationParams, _Mapping]] = ..., request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_image_pb2.InputImage, _Mapping]]] = ..., cache: _Optional[_Union[_stages_pb2.StepCache, _Mapping]] = ..., loras: _Optional[_Iterable[_Union[_stages_pb2.LoraAdapter, _Mapping]]] = ..., output_format: _Optional[str] = ..., output_quality: _Optional[int] = ..., keep_raw_frames: _Optional[bool] = ..., notices: _Optional[_Iterable[_Union[_stages_pb2.Notice, _Mapping]]] = ..., embedded_guidance_scale: _Optional[float] = ..., audio_codec: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "state", "request", "created_at", "finished_at", "queue_position", "current_stage", "error", "timings", "num_frames_out", "fps_out", "transformer_passes", "progress", "progress_percent", "media_type", "download_url", "notices", "preemptions")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_OUT_FIELD_NUMBER: _ClassVar[int]
    FPS_OUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMER_PASSES_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_URL_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    request: GenerateRequest
    created_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    queue_position: int
    current_stage: str
    error: JobError
    timings: _containers.ScalarMap[str, float]
    num_frames_out: int
    fps_out: float
    transformer_passes: _stages_pb2.TransformerPasses
    progress: StageProgress
    progress_percent: float
    media_type: str
    download_url: str
    notices: _containers.RepeatedCompositeFieldContainer[_stages_pb2.Notice]
    preemptions: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., queue_position: _Optional[int] = ..., current_stage: _Optional[str] = ..., error: _Optional[_Union[JobError, _Mapping]] = ..., timings: _Optional[_Mapping[str, float]] = ..., num_frames_out: _Optional[int] = ..., fps_out: _Optional[float] = ..., transformer_passes: _Optional[_Union[_stages_pb2.TransformerPasses, _Mapping]] = ..., progress: _Optional[_Union[StageProgress, _Mapping]] = ..., progress_percent: _Optional[float] = ..., media_type: _Optional[str] = ..., download_url: _Optional[str] = ..., notices: _Optional[_Iterable[_Union[_stages_pb2.Notice, _Mapping]]] = ..., preemptions: _Optional[int] = ...) -> None: ...

class JobQueued(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class JobPaused(_message.Message):
    __slots__ = ("stage", "step", "total", "reason", "preemptions")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    step: int
    total: int
    reason: str
    preemptions: int
    def __init__(self, stage: _Optional[str] = ..., step: _Optional[int] = ..., total: _Optional[int] = ..., reason: _Optional[str] = ..., preemptions: _Optional[int] = ...) -> None: ...

class JobResumed(_message.Message):
    __slots__ = ("stage", "step", "total")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    step: int
    total: int
    def __init__(self, stage: _Optional[str] = ..., step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class StageProgress(_message.Message):
    __slots__ = ("stage", "step", "total")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    step: int
    total: int
    def __init__(self, stage: _Optional[str] = ..., step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class EncodedChunk(_message.Message):
    __slots__ = ("media_type", "offset", "data", "last")
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    media_type: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, media_type: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ResultChunk(_message.Message):
    __slots__ = ("tensor", "fps", "encoded", "audio_sample_rate")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorChunk
    fps: float
    encoded: EncodedChunk
    audio_sample_rate: int
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., fps: _Optional[float] = ..., encoded: _Optional[_Union[EncodedChunk, _Mapping]] = ..., audio_sample_rate: _Optional[int] = ...) -> None: ...

class JobCompleted(_message.Message):
    __slots__ = ("timings", "num_frames", "fps", "transformer_passes", "media_type", "encoded_bytes", "seed", "notices")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    TRANSFORMER_PASSES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENCODED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    timings: _containers.ScalarMap[str, float]
    num_frames: int
    fps: float
    transformer_passes: _stages_pb2.TransformerPasses
    media_type: str
    encoded_bytes: int
    seed: int
    notices: _containers.RepeatedCompositeFieldContainer[_stages_pb2.Notice]
    def __init__(self, timings: _Optional[_Mapping[str, float]] = ..., num_frames: _Optional[int] = ..., fps: _Optional[float] = ..., transformer_passes: _Optional[_Union[_stages_pb2.TransformerPasses, _Mapping]] = ..., media_type: _Optional[str] = ..., encoded_bytes: _Optional[int] = ..., seed: _Optional[int] = ..., notices: _Optional[_Iterable[_Union[_stages_pb2.Notice, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("job_id", "queued", "progress", "result", "completed", "paused", "resumed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    queued: JobQueued
    progress: StageProgress
    result: ResultChunk
    completed: JobCompleted
    paused: JobPaused
    resumed: JobResumed
    def __init__(self, job_id: _Optional[str] = ..., queued: _Optional[_Union[JobQueued, _Mapping]] = ..., progress: _Optional[_Union[StageProgress, _Mapping]] = ..., result: _Optional[_Union[ResultChunk, _Mapping]] = ..., completed: _Optional[_Union[JobCompleted, _Mapping]] = ..., paused: _Optional[_Union[JobPaused, _Mapping]] = ..., resumed: _Optional[_Union[JobResumed, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job_id", "deleted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    deleted: bool
    def __init__(self, job_id: _Optional[str] = ..., deleted: _Optional[bool] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("state", "limit")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    limit: int
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("id", "family", "limits", "serving_replicas", "status")
    class ServingReplicasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SERVING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    id: str
    family: str
    limits: _stages_pb2.ModelLimits
    serving_replicas: _containers.ScalarMap[str, int]
    status: str
    def __init__(self, id: _Optional[str] = ..., family: _Optional[str] = ..., limits: _Optional[_Union[_stages_pb2.ModelLimits, _Mapping]] = ..., serving_replicas: _Optional[_Mapping[str, int]] = ..., status: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelDescription]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelDescription, _Mapping]]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("endpoint", "health", "detail", "in_flight", "calls", "info")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    health: str
    detail: str
    in_flight: int
    calls: int
    info: _stages_pb2.StageInfo
    def __init__(self, endpoint: _Optional[str] = ..., health: _Optional[str] = ..., detail: _Optional[str] = ..., in_flight: _Optional[int] = ..., calls: _Optional[int] = ..., info: _Optional[_Union[_stages_pb2.StageInfo, _Mapping]] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("info", "endpoint", "health", "detail", "replicas")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    info: _stages_pb2.StageInfo
    endpoint: str
    health: str
    detail: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, info: _Optional[_Union[_stages_pb2.StageInfo, _Mapping]] = ..., endpoint: _Optional[str] = ..., health: _Optional[str] = ..., detail: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class GetClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("stages", "version")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    version: str
    def __init__(self, stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...
