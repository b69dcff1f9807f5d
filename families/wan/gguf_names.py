"""Wan transformer tensor names as published GGUF files spell them: the original Wan repository's names.

GGUF DiTs are converted from the original checkpoints, not from the diffusers ones, so their tensors are
named as in Wan's own code ("blocks.0.self_attn.q.weight"), and diffusers' `from_single_file` renames them
to its own ("blocks.0.attn1.to_q.weight") with `convert_wan_transformer_to_diffusers`. `original_name` is
the inverse of that renaming, used to write GGUF files the way users get them; a test checks that
diffusers' renaming of every name written gives back the model's own.
"""

from __future__ import annotations

# diffusers name part -> original name part, applied in this order. The cross-attention norm is `norm2` in
# diffusers and `norm3` in Wan (and the other way round), so the two swap through a placeholder.
_RENAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
    ("norm2", "norm__swap"),
    ("norm3", "norm2"),
    ("norm__swap", "norm3"),
)


def original_name(name: str) -> str:
    """The original Wan name of a diffusers WanTransformer3DModel state-dict key."""
    if name == "scale_shift_table":
        return "head.modulation"
    name = name.replace(".scale_shift_table", ".modulation")
    for diffusers_part, original_part in _RENAMES:
        name = name.replace(diffusers_part, original_part)
    return name
