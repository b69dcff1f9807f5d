"""The denoising stage: embeddings and a seed in, latents out."""
