"""The text-encoding stage: prompts in, embeddings out."""
