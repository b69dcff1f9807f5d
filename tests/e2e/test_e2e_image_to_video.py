"""Image-to-video through the running cluster: the frames equal WanImageToVideoPipeline's (WanPipeline's for
TI2V without an image) within one level, for each Wan image-to-video family with its DiT on one rank (A14B's VAE
patch-parallel, its Encode whole on rank 0); and input images that cannot be served are refused at the door with
INVALID_ARGUMENT naming the field. Every family's parallel layouts are proven on the latents in
tests/integration/test_family_features.py (the ParallelLayouts classes), the Wan2.2 VAE's patch-parallel decode in
tests/integration/test_vae_patch_parallel.py, and each family's stages against its pipeline, case by case, in
tests/integration/test_family_wan_i2v.py; parallel DiTs run end to end in tests/e2e/test_e2e_parallel.py,
test_e2e_compose_gpu_file.py and test_families_cluster.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.hostile_files import chunk_stuffed_png, comment_stuffed_jpeg, scan_bomb_jpeg
from families.init_model import init_model
from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2
from tests.helpers.image_to_video import check_cases, encoded, generate
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image


def _cluster(model: Path, log_dir: Path, extra_args: dict[str, list[str]] | None = None) -> Iterator[LocalCluster]:
    local = LocalCluster(model, threads_per_stage=THREADS_PER_STAGE, log_dir=log_dir, extra_args=extra_args or {})
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("i2v-models")
    return {name: init_model(name, "tiny", root / name, seed=0) for name in ("wan-i2v", "wan2.2-ti2v")}


@pytest.fixture(scope="module")
def wan_i2v_cluster(models, tmp_path_factory) -> Iterator[LocalCluster]:
    yield from _cluster(models["wan-i2v"], tmp_path_factory.mktemp("wan-i2v-logs"))


# This cluster first: the module-scoped wan-i2v cluster starts only after it (Wan2.2 I2V A14B runs in
# tests/e2e/test_e2e_models.py, beside other models).
def test_wan22_ti2v_frames_equal_pipelines(models, tmp_path) -> None:
    """One checkpoint serves image-to-video and, without an image, text-to-video."""
    cases = [
        dict(
            prompt="a red fox runs",
            negative_prompt="blurry",
            height=64,
            width=64,
            num_frames=9,
            steps=2,
            guidance=5.0,
            seed=0,
            images={"first": encoded(input_image(50, 70, 7), "PNG")},
        ),
        dict(prompt="a boat at sea", height=64, width=96, num_frames=5, steps=2, guidance=1.0, seed=4),
    ]
    for cluster in _cluster(models["wan2.2-ti2v"], tmp_path):
        check_cases(cluster, models["wan2.2-ti2v"], cases)


# Input images of other sizes and aspect ratios than the output, in each format the server takes.
WAN_I2V_CASES = [
    dict(
        prompt="a red fox runs",
        negative_prompt="blurry",
        height=64,
        width=64,
        num_frames=9,
        steps=2,
        guidance=5.0,
        seed=0,
        images={"first": encoded(input_image(50, 40, 0), "PNG")},
    ),
    dict(
        prompt="a boat at sea",
        height=48,
        width=80,
        num_frames=5,
        steps=3,
        guidance=1.0,
        seed=3,
        images={"first": encoded(input_image(120, 72, 1), "JPEG", quality=90)},
    ),
    dict(
        prompt="clouds over hills",
        negative_prompt="dark",
        height=32,
        width=64,
        num_frames=5,
        steps=2,
        guidance=4.0,
        seed=7,
        images={"first": encoded(input_image(30, 90, 2), "WEBP", lossless=True)},
    ),
]


def test_wan_i2v_frames_equal_pipeline(wan_i2v_cluster, models) -> None:
    check_cases(wan_i2v_cluster, models["wan-i2v"], WAN_I2V_CASES)


def test_wan_i2v_interpolation_keeps_decoded_frames_in_place(wan_i2v_cluster) -> None:
    plain, _ = generate(wan_i2v_cluster.endpoint, WAN_I2V_CASES[0])
    doubled, _ = generate(wan_i2v_cluster.endpoint, WAN_I2V_CASES[0], interp_exp=1)
    assert doubled.shape[0] == 2 * plain.shape[0] - 1
    np.testing.assert_array_equal(doubled[::2], plain)


def _png_claiming(width: int, height: int) -> bytes:
    """A valid small PNG whose header claims another size (a decompression bomb)."""
    import struct
    import zlib

    data = bytearray(encoded(input_image(8, 8, 0), "PNG"))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13])))
    return bytes(data)


GOOD = encoded(input_image(40, 40, 0), "PNG")
BAD_IMAGES = [
    ("not-an-image", [image_pb2.InputImage(data=b"definitely not an image")], "images[0].data", "PNG, JPEG or WEBP"),
    ("truncated", [image_pb2.InputImage(data=GOOD[: len(GOOD) // 2])], "images[0].data", "complete"),
    ("bomb", [image_pb2.InputImage(data=_png_claiming(20000, 20000))], "images[0].data", "pixels"),
    ("gif", [image_pb2.InputImage(data=encoded(input_image(8, 8, 0), "GIF"))], "images[0].data", "GIF"),
    ("missing", [], "images", "first_frame"),
    (
        "too-many",
        [image_pb2.InputImage(data=GOOD, role=r) for r in (1, 2, 3)],
        "images",
        "at most",
    ),
    (
        "role-not-taken",
        [image_pb2.InputImage(data=GOOD, role=image_pb2.IMAGE_ROLE_LAST_FRAME)],
        "images[0].role",
        "first_frame",
    ),
    ("empty", [image_pb2.InputImage(data=b"")], "images[0].data", "PNG, JPEG or WEBP"),
    ("scan-bomb", [image_pb2.InputImage(data=scan_bomb_jpeg(1024, 2000))], "images[0].data", "32 scans"),
    ("comment-segments", [image_pb2.InputImage(data=comment_stuffed_jpeg())], "images[0].data", "marker segments"),
    ("stuffed-chunks", [image_pb2.InputImage(data=chunk_stuffed_png())], "images[0].data", "chunks besides IDAT"),
]


@pytest.mark.parametrize(
    ("images", "field", "allowed"), [case[1:] for case in BAD_IMAGES], ids=[c[0] for c in BAD_IMAGES]
)
def test_bad_images_are_refused_naming_the_field(wan_i2v_cluster, images, field, allowed) -> None:
    with grpc.insecure_channel(wan_i2v_cluster.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt="a fox", height=64, width=64, num_frames=5, images=images)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Submit(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith(field + ":"), raised.value.details()
    assert allowed in raised.value.details(), raised.value.details()


def test_a_scan_bomb_stalls_no_other_caller(wan_i2v_cluster) -> None:
    """Bombs are refused at the door, and nothing parses them on the event loop or under a lock that the event
    loop waits for: the orchestrator answers another caller at once while two of them arrive."""
    bomb = generation_pb2.GenerateRequest(
        prompt="a fox", images=[image_pb2.InputImage(data=scan_bomb_jpeg(4096, 3000))]
    )
    with grpc.insecure_channel(wan_i2v_cluster.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        refused = [stub.Submit.future(bomb, timeout=120) for _ in range(2)]
        time.sleep(0.5)
        started = time.monotonic()
        stub.ListModels(generation_pb2.ListModelsRequest(), timeout=30)
        assert time.monotonic() - started < 5.0
        for call in refused:
            with pytest.raises(grpc.RpcError) as raised:
                call.result(timeout=120)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()


def test_a_request_message_over_its_small_limit_is_refused_before_parsing(wan_i2v_cluster) -> None:
    from services.orchestrator.service import MAX_REQUEST_BYTES

    request = generation_pb2.GenerateRequest(
        prompt="a fox", images=[image_pb2.InputImage(data=b"\x89PNG" + bytes(MAX_REQUEST_BYTES))]
    )
    with grpc.insecure_channel(wan_i2v_cluster.endpoint) as channel, pytest.raises(grpc.RpcError) as raised:
        generation_pb2_grpc.GenerationStub(channel).Submit(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_large_image_travels_through_an_upload_that_its_job_takes(wan_i2v_cluster) -> None:
    """The SDK sends an image over 1 MiB ahead through UploadImage; the job records the file it took, and the
    upload is gone once the job exists."""
    import hashlib

    large = GOOD + bytes(6 << 20)  # bytes after the PNG's end, which every reader ignores
    with Client(wan_i2v_cluster.endpoint) as client:
        job = client.submit("a fox", image=large, height=64, width=64, num_frames=5, num_inference_steps=1)
        try:
            assert job.request.images[0].sha256 == hashlib.sha256(large).hexdigest()
            assert not job.request.images[0].upload_id
            assert list((wan_i2v_cluster.state_dir / "uploads").iterdir()) == []
        finally:
            client.delete(job.job_id)
    with grpc.insecure_channel(wan_i2v_cluster.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        too_large = (image_pb2.ImageUploadChunk(data=bytes(1 << 20)) for _ in range(17))
        with pytest.raises(grpc.RpcError) as raised:
            stub.UploadImage(too_large, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
        assert "more than 16777216 bytes" in raised.value.details()
        named = generation_pb2.GenerateRequest(
            prompt="a fox", images=[image_pb2.InputImage(upload_id="0" * 32)], height=64, width=64, num_frames=5
        )
        with pytest.raises(grpc.RpcError) as raised:
            stub.Submit(named, timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("images[0].upload_id: no upload with this id")
        # A request refused for what it asks takes its upload too: the uploads a tenant holds stay bounded.
        uploaded = stub.UploadImage(iter([image_pb2.ImageUploadChunk(data=GOOD)]), timeout=30)
        named.images[0].upload_id = uploaded.upload_id
        named.num_frames = 6  # not 4k+1
        for expected in ("num_frames", "images[0].upload_id: no upload with this id"):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Submit(named, timeout=30)
            assert raised.value.details().startswith(expected), raised.value.details()
