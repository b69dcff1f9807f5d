"""The decoding stage: latent frames in, video frames out, one temporal chunk at a time."""
