"""gRPC servicer of the text-encoding stage.

The family read from the checkpoint picks the compute, which encodes the request's texts into batched
tensors: "embeds" [N, L, dim] and, for families whose texts keep their own length (Qwen-Image, zero-padded
to the longest text), "embeds_mask" [N, L] (INT64, 1 for a token, 0 for padding). The stage answers with
each text's tensors named as the DiT takes them, so that the orchestrator relays them untouched: texts[0],
the prompt, as "prompt_embeds" [1, L, dim] (then "prompt_embeds_mask" [1, L]), texts[1], the negative
prompt, as "negative_prompt_embeds" (then "negative_prompt_embeds_mask"). Wan's embeddings are zero past
each text and padded to max_sequence_length, as WanPipeline makes them.

A family whose conditioning encoder sees the input images gets the request's `images`, decoded and checked
against the checkpoint's roles (services/input_images.py). Either its image embedding follows the texts'
tensors ("image_embeds": Wan2.1 image-to-video's CLIP vision), or, for an encoder that embeds each text
together with the images (`PromptEncoder.texts_see_images`: Qwen2.5-VL of Qwen-Image-Edit), the texts'
tensors are made with them and nothing else is sent. A family whose encoder does not see images refuses them.

A text the family's pipeline cuts to the tokens it takes (Wan's UMT5 at max_sequence_length, 512 by default)
is cut here as there, and reported: the first response carries a `Notice` per cut text (field "prompt" or
"negative_prompt", given and used in tokens), which the orchestrator adds to the job.

Embeddings are cached per `cache_namespace` (stagekit/encoder.py says why), within
`--embedding-cache-bytes` and `--embedding-cache-size` entries. Every field of a request is bounded
before it is used, and a field out of bounds is refused with INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import grpc

from services.environment_options import parse_args
from services.image_work import ImageWorkers
from services.images import Stop
from services.input_images import decode_stage_images
from services.memory_budget import WeightNeed, stage_need, text_encoder_components
from services.model_source import stage_model
from services.stage import RequestError, StageRuntime, abort_for, parameter_bytes
from services.stage_config import StageConfig
from services.stage_main import StageServicer, run_stage
from services.torch_wire import encode_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from stagekit.encoder import PromptEncoder, Truncation
from stagekit.images import DecodedImage
from text_encoder_svc.config import EmbeddingCacheConfig, TextEncoderConfig
from text_encoder_svc.options import build_parser

# The orchestrator sends the prompt, and the negative prompt when guidance is on; each text's tensors are
# named after its role (the DiT's "prompt_embeds", "negative_prompt_embeds").
TEXT_ROLES = ("prompt", "negative_prompt")
MAX_TEXTS = len(TEXT_ROLES)
# Longer than any served model id (a directory name or --model-name) is ever meant to be.
MAX_MODEL_CHARS = 256
# The orchestrator's namespaces are 32-byte HMAC-SHA256 digests.
MAX_CACHE_NAMESPACE_BYTES = 64


def truncation_notice(role: str, cut: Truncation) -> stages_pb2.Notice:
    """The notice of a text (`role`: "prompt" or "negative_prompt") cut to the tokens the model takes."""
    return stages_pb2.Notice(
        field=role,
        given=f"{cut.given} tokens",
        used=f"{cut.kept} tokens",
        message=f"the {role.replace('_', ' ')} was truncated to {cut.kept} tokens ({cut.given} given); "
        f"the {cut.encoder or 'text'} encoder takes at most {cut.kept}",
        source="text-encoder",
    )


class TextEncoderServicer(stages_pb2_grpc.TextEncoderServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["TextEncoder"].full_name

    def __init__(self, cache: EmbeddingCacheConfig, runtime: StageRuntime) -> None:
        self.cache = cache
        self.runtime = runtime
        self.encoder: PromptEncoder | None = None
        self.image_workers = ImageWorkers()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_TextEncoderServicer_to_server(self, server)

    def load(self) -> None:
        spec, runtime = self.runtime.checkpoint, self.runtime
        encoder_class = spec.traits.load("text_encoder")
        self.encoder = encoder_class(
            spec.path,
            spec.model_id,
            runtime.device,
            runtime.dtype,
            cache_bytes=self.cache.max_bytes,
            cache_entries=self.cache.max_entries,
            load_threads=runtime.load_threads,
        )
        self.runtime.parameter_bytes = {name: parameter_bytes(module) for name, module in self.encoder.modules.items()}

    def memory_need(self) -> WeightNeed:
        """The checkpoint's transformers models (the text encoder, and the image encoder of families that have
        one) and the other components the family's encoder loads (LTX-2's connectors) in the stage's dtype; the
        stage has no offload, so a smaller dtype is the only fix."""
        runtime = self.runtime
        others = getattr(runtime.checkpoint.traits.load("text_encoder"), "other_components", ())
        components = text_encoder_components(runtime.checkpoint.path, others)
        fixes = ["--device cpu, where this machine's memory holds them"] if runtime.device.type == "cuda" else []
        return stage_need(runtime.stage, runtime.device, runtime.dtype, components, fixes=fixes)

    def _validate(self, request: stages_pb2.EncodeRequest) -> int:
        spec = self.runtime.checkpoint
        if len(request.model) > MAX_MODEL_CHARS:
            raise RequestError(f"model: {len(request.model)} characters; at most {MAX_MODEL_CHARS} are allowed")
        self.runtime.check_model(request.model)
        if len(request.cache_namespace) > MAX_CACHE_NAMESPACE_BYTES:
            raise RequestError(
                f"cache_namespace: {len(request.cache_namespace)} bytes; at most {MAX_CACHE_NAMESPACE_BYTES} "
                "are allowed"
            )
        if not 1 <= len(request.texts) <= MAX_TEXTS:
            raise RequestError(f"texts: {len(request.texts)} given; send between 1 and {MAX_TEXTS}")
        for i, text in enumerate(request.texts):
            if len(text) > spec.max_prompt_chars:
                raise RequestError(f"texts[{i}]: {len(text)} characters; at most {spec.max_prompt_chars} are allowed")
        length = request.max_sequence_length or spec.max_sequence_length
        if not 1 <= length <= spec.sequence_length_limit:
            raise RequestError(
                f"max_sequence_length: {length} is out of range; allowed 1..{spec.sequence_length_limit}"
            )
        return length

    def _decode_images(self, request: stages_pb2.EncodeRequest, stop: Stop) -> list[DecodedImage]:
        """The request's images, for a family whose conditioning encoder embeds them (else refused)."""
        spec = self.runtime.checkpoint
        if not request.images:
            return []
        if "text-encoder" not in spec.traits.images.encoded_by:
            raise RequestError(
                f"images: the text encoder of {spec.family} does not see input images; send them to the VAE's "
                "Encode only"
            )
        return decode_stage_images(request.images, spec, stop)

    def _truncation_notices(self, texts: list[str], length: int) -> list[stages_pb2.Notice]:
        """A notice for each text the family's pipeline cuts at `length` tokens."""
        assert self.encoder is not None  # Encode answers only once the model is loaded
        notices = []
        for role, text in zip(TEXT_ROLES, texts, strict=False):
            cut = self.encoder.truncation(text, length)
            if cut is not None:
                notices.append(truncation_notice(role, cut))
        return notices

    async def Encode(
        self,
        request: stages_pb2.EncodeRequest,
        context: grpc.aio.ServicerContext[stages_pb2.EncodeRequest, stages_pb2.EncodeResponse],
    ) -> AsyncIterator[stages_pb2.EncodeResponse]:
        if self.encoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "text-encoder: still loading its model")
        image_embeds = None
        try:
            length = self._validate(request)
            images = await self.image_workers.run(functools.partial(self._decode_images, request))
            texts, namespace = list(request.texts), request.cache_namespace
            joint = images if self.encoder.texts_see_images else []
            batched, cache_hit = await self.runtime.run(
                self.encoder.encode,
                texts,
                length,
                namespace,
                [item.image for item in joint],
                [item.sha256 for item in joint],
            )
            if images and not joint:
                image_embeds, images_hit = await self.runtime.run(
                    self.encoder.encode_images,
                    [item.image for item in images],
                    [item.sha256 for item in images],
                    namespace,
                )
                cache_hit = cache_hit and images_hit
            notices = await self.runtime.run(self._truncation_notices, texts, length)
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)
        first = True
        # Each text's tensors, named as the DiT takes them: "embeds" -> "prompt_embeds", "embeds_mask" ->
        # "prompt_embeds_mask" for texts[0]; "negative_prompt_embeds"(+"_mask") for texts[1].
        for i, role in enumerate(TEXT_ROLES[: len(texts)]):
            for name, tensor in batched.items():
                for chunk in encode_tensor(f"{role}_{name}", tensor[i : i + 1]):
                    yield stages_pb2.EncodeResponse(
                        tensor=chunk, cache_hit=cache_hit and first, notices=notices if first else ()
                    )
                    first = False
        if image_embeds is not None:
            for chunk in encode_tensor(self.encoder.image_tensor_name, image_embeds):
                yield stages_pb2.EncodeResponse(tensor=chunk)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        cache = EmbeddingCacheConfig.from_options(args)
    except ValueError as error:
        parser.error(str(error))
    args.model = stage_model("text-encoder", args.model)
    args.also_serve = [stage_model("text-encoder", path, "--also-serve") for path in args.also_serve]
    config = TextEncoderConfig(stage=StageConfig.from_args("text-encoder", args), cache=cache)
    run_stage(config.stage, functools.partial(TextEncoderServicer, config.cache))


if __name__ == "__main__":
    main()
