from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_ROLE_UNSPECIFIED: _ClassVar[ImageRole]
    IMAGE_ROLE_FIRST_FRAME: _ClassVar[ImageRole]
    IMAGE_ROLE_LAST_FRAME: _ClassVar[ImageRole]
    IMAGE_ROLE_REFERENCE: _ClassVar[ImageRole]
IMAGE_ROLE_UNSPECIFIED: ImageRole
IMAGE_ROLE_FIRST_FRAME: ImageRole
IMAGE_ROLE_LAST_FRAME: ImageRole
IMAGE_ROLE_REFERENCE: ImageRole

class InputImage(_message.Message):
    __slots__ = ("data", "role", "sha256", "width", "height", "upload_id")
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    role: ImageRole
    sha256: str
    width: int
    height: int
    upload_id: str
    def __init__(self, data: _Optional[bytes] = ..., role: _Optional[_Union[ImageRole, str]] = ..., sha256: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., upload_id: _Optional[str] = ...) -> None: ...

class ImageUploadChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class UploadedImage(_message.Message):
    __slots__ = ("upload_id", "size_bytes", "sha256", "expires_in_s")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    size_bytes: int
    sha256: str
    expires_in_s: float
    def __init__(self, upload_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class ImageSize(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...
