"""gRPC servicer of the text-encoding stage.

The family read from the checkpoint picks the compute. Wan's UMT5 embeddings answer as one tensor
"embeds" [N, 512, dim] (zero past each text, as WanPipeline makes them). Qwen-Image's have each text's
own length: they answer as "embeds" [N, L, dim], zero-padded to the longest text, then "embeds_mask"
[N, L] (INT64, 1 for a token, 0 for padding), which the DiT needs as `encoder_hidden_states_mask`.

Embeddings are cached per `cache_namespace` (text_encoder_svc/encoder.py says why), within
`--embedding-cache-bytes` and `--embedding-cache-size` entries. Every field of a request is bounded
before it is used, and a field out of bounds is refused with INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import argparse

import grpc

from services.environment_options import parse_args
from services.stage import RequestError, StageRuntime, abort_for, parameter_bytes
from services.stage_main import StageServicer, add_stage_arguments, run_stage
from services.tensor_codec import encode_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from text_encoder_svc.encoder import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES, PromptEncoder
from text_encoder_svc.qwen_encoder import QwenPromptEncoder

# The orchestrator sends the prompt, and the negative prompt when guidance is on.
MAX_TEXTS = 2
# Longer than any served model id (a directory name or --model-name) is ever meant to be.
MAX_MODEL_CHARS = 256
# The orchestrator's namespaces are 32-byte HMAC-SHA256 digests.
MAX_CACHE_NAMESPACE_BYTES = 64


class TextEncoderServicer(stages_pb2_grpc.TextEncoderServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["TextEncoder"].full_name

    def __init__(self, args: argparse.Namespace, runtime: StageRuntime) -> None:
        self.args = args
        self.runtime = runtime
        self.encoder: PromptEncoder | QwenPromptEncoder | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_TextEncoderServicer_to_server(self, server)

    def load(self) -> None:
        spec = self.runtime.spec
        runtime = self.runtime
        if spec.family == "qwen-image":
            self.encoder = QwenPromptEncoder(
                spec.path,
                spec.model_id,
                runtime.device,
                runtime.dtype,
                cache_bytes=self.args.embedding_cache_bytes,
                cache_entries=self.args.embedding_cache_size,
                load_threads=runtime.load_threads,
            )
        else:
            self.encoder = PromptEncoder(
                spec.path,
                spec.model_id,
                runtime.device,
                runtime.dtype,
                cache_bytes=self.args.embedding_cache_bytes,
                cache_entries=self.args.embedding_cache_size,
                load_threads=runtime.load_threads,
            )
        self.runtime.parameter_bytes = {"text_encoder": parameter_bytes(self.encoder.text_encoder)}

    def _validate(self, request: stages_pb2.EncodeRequest) -> int:
        spec = self.runtime.spec
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

    async def Encode(self, request, context):
        if self.encoder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "text-encoder: still loading its model")
        try:
            length = self._validate(request)
            mask = None
            texts, namespace = list(request.texts), request.cache_namespace
            if isinstance(self.encoder, QwenPromptEncoder):
                embeds, mask, cache_hit = await self.runtime.run(self.encoder.encode, texts, length, namespace)
            else:
                embeds, cache_hit = await self.runtime.run(self.encoder.encode, texts, length, namespace)
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)
        for i, chunk in enumerate(encode_tensor("embeds", embeds)):
            yield stages_pb2.EncodeResponse(tensor=chunk, cache_hit=cache_hit and i == 0)
        if mask is not None:
            for chunk in encode_tensor("embeds_mask", mask):
                yield stages_pb2.EncodeResponse(tensor=chunk)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stagediff serve text-encoder", description=__doc__)
    add_stage_arguments(parser, default_port=50061)
    parser.add_argument(
        "--embedding-cache-bytes",
        type=int,
        default=DEFAULT_CACHE_BYTES,
        help="bytes of embeddings kept in the LRU cache; 0 disables it (default: %(default)s, 256 MiB)",
    )
    parser.add_argument(
        "--embedding-cache-size",
        type=int,
        default=DEFAULT_CACHE_ENTRIES,
        help="texts kept in the LRU cache, within --embedding-cache-bytes; 0 disables it (default: %(default)s)",
    )
    args = parse_args(parser, argv)
    for flag, value in (
        ("--embedding-cache-bytes", args.embedding_cache_bytes),
        ("--embedding-cache-size", args.embedding_cache_size),
    ):
        if value < 0:
            parser.error(f"{flag} {value}: use 0 or more (0 disables the cache)")
    run_stage("text-encoder", args, TextEncoderServicer)


if __name__ == "__main__":
    main()
