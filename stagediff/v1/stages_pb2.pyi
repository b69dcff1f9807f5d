from stagediff.v1 import image_pb2 as _image_pb2
from stagediff.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageInfo(_message.Message):
    __slots__ = ("stage", "model", "family", "device", "parallel_config", "parameter_bytes", "limits", "version", "weights_path", "base_model", "components", "model_components", "models", "step_scheduling", "step_slots")
    class ParallelConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ParameterBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ModelComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    STEP_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    STEP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    model: str
    family: str
    device: str
    parallel_config: _containers.ScalarMap[str, str]
    parameter_bytes: _containers.ScalarMap[str, int]
    limits: ModelLimits
    version: str
    weights_path: str
    base_model: str
    components: _containers.ScalarMap[str, str]
    model_components: _containers.ScalarMap[str, str]
    models: _containers.RepeatedScalarFieldContainer[str]
    step_scheduling: bool
    step_slots: int
    def __init__(self, stage: _Optional[str] = ..., model: _Optional[str] = ..., family: _Optional[str] = ..., device: _Optional[str] = ..., parallel_config: _Optional[_Mapping[str, str]] = ..., parameter_bytes: _Optional[_Mapping[str, int]] = ..., limits: _Optional[_Union[ModelLimits, _Mapping]] = ..., version: _Optional[str] = ..., weights_path: _Optional[str] = ..., base_model: _Optional[str] = ..., components: _Optional[_Mapping[str, str]] = ..., model_components: _Optional[_Mapping[str, str]] = ..., models: _Optional[_Iterable[str]] = ..., step_scheduling: _Optional[bool] = ..., step_slots: _Optional[int] = ...) -> None: ...

class ModelLimits(_message.Message):
    __slots__ = ("height_multiple", "width_multiple", "temporal_factor", "max_height", "max_width", "max_frames", "max_inference_steps", "max_sequence_length", "max_prompt_chars", "default_height", "default_width", "default_num_frames", "default_inference_steps", "default_guidance_scale", "default_fps", "min_height", "image_roles", "required_image_roles", "max_images", "max_image_bytes", "max_image_pixels", "cache_methods", "default_cache", "loras", "max_loras", "fused_loras", "lora_cache_bytes", "default_embedded_guidance_scale", "image_size_base", "audio_sample_rate", "audio_channels")
    HEIGHT_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MAX_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FPS_FIELD_NUMBER: _ClassVar[int]
    MIN_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ROLES_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_IMAGE_ROLES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    CACHE_METHODS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CACHE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    FUSED_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_EMBEDDED_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_BASE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    height_multiple: int
    width_multiple: int
    temporal_factor: int
    max_height: int
    max_width: int
    max_frames: int
    max_inference_steps: int
    max_sequence_length: int
    max_prompt_chars: int
    default_height: int
    default_width: int
    default_num_frames: int
    default_inference_steps: int
    default_guidance_scale: float
    default_fps: float
    min_height: int
    image_roles: _containers.RepeatedScalarFieldContainer[str]
    required_image_roles: _containers.RepeatedScalarFieldContainer[str]
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    cache_methods: _containers.RepeatedCompositeFieldContainer[StepCache]
    default_cache: StepCache
    loras: _containers.RepeatedCompositeFieldContainer[LoraInfo]
    max_loras: int
    fused_loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    lora_cache_bytes: int
    default_embedded_guidance_scale: float
    image_size_base: int
    audio_sample_rate: int
    audio_channels: int
    def __init__(self, height_multiple: _Optional[int] = ..., width_multiple: _Optional[int] = ..., temporal_factor: _Optional[int] = ..., max_height: _Optional[int] = ..., max_width: _Optional[int] = ..., max_frames: _Optional[int] = ..., max_inference_steps: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., max_prompt_chars: _Optional[int] = ..., default_height: _Optional[int] = ..., default_width: _Optional[int] = ..., default_num_frames: _Optional[int] = ..., default_inference_steps: _Optional[int] = ..., default_guidance_scale: _Optional[float] = ..., default_fps: _Optional[float] = ..., min_height: _Optional[int] = ..., image_roles: _Optional[_Iterable[str]] = ..., required_image_roles: _Optional[_Iterable[str]] = ..., max_images: _Optional[int] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., cache_methods: _Optional[_Iterable[_Union[StepCache, _Mapping]]] = ..., default_cache: _Optional[_Union[StepCache, _Mapping]] = ..., loras: _Optional[_Iterable[_Union[LoraInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., fused_loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., lora_cache_bytes: _Optional[int] = ..., default_embedded_guidance_scale: _Optional[float] = ..., image_size_base: _Optional[int] = ..., audio_sample_rate: _Optional[int] = ..., audio_channels: _Optional[int] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class LoraInfo(_message.Message):
    __slots__ = ("name", "bytes", "load_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes: int
    load_bytes: int
    def __init__(self, name: _Optional[str] = ..., bytes: _Optional[int] = ..., load_bytes: _Optional[int] = ...) -> None: ...

class StepCache(_message.Message):
    __slots__ = ("method", "threshold")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    method: str
    threshold: float
    def __init__(self, method: _Optional[str] = ..., threshold: _Optional[float] = ...) -> None: ...

class TransformerPasses(_message.Message):
    __slots__ = ("run", "skipped")
    RUN_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    run: int
    skipped: int
    def __init__(self, run: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("field", "given", "used", "message", "source")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    GIVEN_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    field: str
    given: str
    used: str
    message: str
    source: str
    def __init__(self, field: _Optional[str] = ..., given: _Optional[str] = ..., used: _Optional[str] = ..., message: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class GetStageInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("model", "texts", "max_sequence_length", "cache_namespace", "images")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    max_sequence_length: int
    cache_namespace: bytes
    images: _containers.RepeatedCompositeFieldContainer[_image_pb2.InputImage]
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., max_sequence_length: _Optional[int] = ..., cache_namespace: _Optional[bytes] = ..., images: _Optional[_Iterable[_Union[_image_pb2.InputImage, _Mapping]]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("tensor", "cache_hit", "notices")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    NOTICES_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorChunk
    cache_hit: bool
    notices: _containers.RepeatedCompositeFieldContainer[Notice]
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., cache_hit: _Optional[bool] = ..., notices: _Optional[_Iterable[_Union[Notice, _Mapping]]] = ...) -> None: ...

class DenoiseParams(_message.Message):
    __slots__ = ("model", "height", "width", "num_frames", "num_inference_steps", "guidance_scale", "seed", "image_roles", "image_sizes", "cache", "loras", "batch_group", "embedded_guidance_scale", "fps", "call_id", "checkpoint_every")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ROLES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZES_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    BATCH_GROUP_FIELD_NUMBER: _ClassVar[int]
    EMBEDDED_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    model: str
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    image_roles: _containers.RepeatedScalarFieldContainer[str]
    image_sizes: _containers.RepeatedCompositeFieldContainer[_image_pb2.ImageSize]
    cache: StepCache
    loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    batch_group: bytes
    embedded_guidance_scale: float
    fps: float
    call_id: str
    checkpoint_every: int
    def __init__(self, model: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_frames: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., image_roles: _Optional[_Iterable[str]] = ..., image_sizes: _Optional[_Iterable[_Union[_image_pb2.ImageSize, _Mapping]]] = ..., cache: _Optional[_Union[StepCache, _Mapping]] = ..., loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., batch_group: _Optional[bytes] = ..., embedded_guidance_scale: _Optional[float] = ..., fps: _Optional[float] = ..., call_id: _Optional[str] = ..., checkpoint_every: _Optional[int] = ...) -> None: ...

class DenoiseRequest(_message.Message):
    __slots__ = ("params", "tensor")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    params: DenoiseParams
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, params: _Optional[_Union[DenoiseParams, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class DenoiseProgress(_message.Message):
    __slots__ = ("step", "total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class DenoiseResponse(_message.Message):
    __slots__ = ("progress", "tensor", "passes", "yielded")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    YIELDED_FIELD_NUMBER: _ClassVar[int]
    progress: DenoiseProgress
    tensor: _tensor_pb2.TensorChunk
    passes: TransformerPasses
    yielded: DenoiseYielded
    def __init__(self, progress: _Optional[_Union[DenoiseProgress, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., passes: _Optional[_Union[TransformerPasses, _Mapping]] = ..., yielded: _Optional[_Union[DenoiseYielded, _Mapping]] = ...) -> None: ...

class DenoiseYielded(_message.Message):
    __slots__ = ("step", "total", "draining")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    draining: bool
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class YieldRequest(_message.Message):
    __slots__ = ("call_id",)
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    def __init__(self, call_id: _Optional[str] = ...) -> None: ...

class YieldResponse(_message.Message):
    __slots__ = ("yielding", "reason")
    YIELDING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    yielding: bool
    reason: str
    def __init__(self, yielding: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DecodeParams(_message.Message):
    __slots__ = ("model", "num_latent_frames")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LATENT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_latent_frames: int
    def __init__(self, model: _Optional[str] = ..., num_latent_frames: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("params", "tensor")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    params: DecodeParams
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, params: _Optional[_Union[DecodeParams, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class VaeEncodeRequest(_message.Message):
    __slots__ = ("model", "height", "width", "num_frames", "images")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    height: int
    width: int
    num_frames: int
    images: _containers.RepeatedCompositeFieldContainer[_image_pb2.InputImage]
    def __init__(self, model: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_frames: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_image_pb2.InputImage, _Mapping]]] = ...) -> None: ...

class VaeEncodeResponse(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class InterpolateParams(_message.Message):
    __slots__ = ("exp", "scale", "model_path")
    EXP_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    exp: int
    scale: float
    model_path: str
    def __init__(self, exp: _Optional[int] = ..., scale: _Optional[float] = ..., model_path: _Optional[str] = ...) -> None: ...

class InterpolateRequest(_message.Message):
    __slots__ = ("params", "tensor")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    params: InterpolateParams
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, params: _Optional[_Union[InterpolateParams, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class InterpolateResponse(_message.Message):
    __slots__ = ("tensor",)
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    tensor: _tensor_pb2.TensorChunk
    def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...
