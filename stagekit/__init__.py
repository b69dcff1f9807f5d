"""The layer that model families and stage runtimes both build on.

It holds what a family implements and uses: the stage protocols (encoder.py `PromptEncoder` with its
embedding cache, denoise.py `Denoiser` and the request's `DenoiseSpec`, decode.py `LatentDecoder`,
model_options.py `TransformerOptions`), the pieces of a denoising step every family shares (guidance
branches, agreeing to stop), the GGUF loader (gguf.py) and the generic parallel machinery (parallel/).

Rules: stage runtimes (dit_svc, text_encoder_svc, vae_svc, interp_svc) -> families -> stagekit, never back;
this package imports no family and no stage package (tests/unit/test_layers.py). Nothing here imports torch
at package level, so that `stagekit.cache_defaults` stays light for the stages' option parsers.
"""
