"""Exact attention over a token sequence split across ranks: Ulysses, Ring and their hybrid (USP).

Every function takes q, k, v laid out as WanAttnProcessor hands them to dispatch_attention_fn, [B, S_local, H, D],
and returns the attention output for the local queries in the same layout. A key_padding_mask [B, S_local]
(True = padded key) marks keys that must get zero weight: the sequence-parallel hooks pad the token count to a
multiple of the degree, and the padding must not change the result.

- Ulysses trades the sequence split for a head split with one all-to-all, runs ordinary attention over the whole
  sequence with H / u heads, and trades back.
- Ring keeps the heads and passes K/V blocks around the group; each block's partial result is merged exactly
  through its log-sum-exp.
- USP runs Ulysses inside (contiguous ranks) and Ring across (strided ranks), matching stagekit/parallel/mesh.py.
- Joint USP (`joint_usp_attention`) adds a context stream that every rank holds whole (Qwen-Image's text): its
  queries and keys join the split sequence's; it takes the rank's head group, and its keys are attended once,
  with the rank's own block.

Only torch.distributed point-to-point and all-to-all calls are used, so the same code runs on gloo and NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Memory-efficient attention on CUDA reads the bias with aligned loads; SDPA pads
# its storage to this many elements (see preprocess_mask in aten's attention.cpp).
_CUDA_BIAS_ALIGNMENT = 16


def _group_size(group: dist.ProcessGroup | None) -> int:
    """None stands for "no split along this axis" (a size-1 group needs no communication)."""
    return 1 if group is None else dist.get_world_size(group)


def _key_padding_bias(key_padding_mask: torch.Tensor, dtype: torch.dtype, padded_len: int) -> torch.Tensor:
    """Additive bias [B, 1, 1, padded_len]: 0 for real keys, -inf for padded ones (and the alignment tail)."""
    batch_size, key_len = key_padding_mask.shape
    bias = torch.full((batch_size, 1, 1, padded_len), float("-inf"), dtype=dtype, device=key_padding_mask.device)
    bias[..., :key_len] = torch.where(key_padding_mask, float("-inf"), 0.0)[:, None, None, :]
    return bias


def _attention_with_lse_cpu(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # The CPU flash kernel takes [B, H, S, D] and returns the output as [B, H, S, D] and the LSE as [B, H, S]
    # (both transposed views of [B, S, H, ...] storage). Its mask must share the query's dtype (additive).
    attn_mask = None
    if key_padding_mask is not None:
        attn_mask = _key_padding_bias(key_padding_mask, query.dtype, key.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask
    )
    return out.transpose(1, 2), lse.transpose(1, 2)


def _attention_with_lse_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # Memory-efficient attention: takes a bias (flash does not) and any of fp32/fp16/bf16. Layout [B, H, S, D];
    # its LSE [B, H, S_pad] is padded along the sequence to a multiple of 32, so keep the first S_q entries.
    batch_size, query_len, num_heads, _ = query.shape
    key_len = key.shape[1]
    attn_bias = None
    if key_padding_mask is not None:
        padded_len = -(-key_len // _CUDA_BIAS_ALIGNMENT) * _CUDA_BIAS_ALIGNMENT
        attn_bias = _key_padding_bias(key_padding_mask, query.dtype, padded_len)[..., :key_len]
        attn_bias = attn_bias.expand(batch_size, num_heads, query_len, key_len)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_bias, True
    )
    return out.transpose(1, 2), lse[:, :, :query_len].transpose(1, 2)


def _attention_with_lse_math(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention in fp32, for devices without an LSE-returning kernel."""
    scale = query.shape[-1] ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", query.float(), key.float()) * scale
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, value.float())
    return out.to(query.dtype), lse.transpose(1, 2)


def attention_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp, which exact block merging needs.

    query [B, S_q, H, D], key/value [B, S_k, H, D], key_padding_mask [B, S_k] (True = padded).
    Returns out [B, S_q, H, D] in the query's dtype and lse [B, S_q, H] in fp32. A batch row whose keys
    are all padding gets out = 0 and lse = -inf, so that merging it adds nothing (kernels disagree
    here: the CPU flash kernel returns lse = 0 for such rows, which would count as a real block).
    """
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, lse = _attention_with_lse_cpu(query, key, value, key_padding_mask)
    elif query.device.type == "cuda" and query.dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, lse = _attention_with_lse_cuda(query, key, value, key_padding_mask)
    else:
        out, lse = _attention_with_lse_math(query, key, value, key_padding_mask)
    lse = lse.float()
    if key_padding_mask is not None:
        no_keys = key_padding_mask.all(dim=1)
        out = torch.where(no_keys[:, None, None, None], 0.0, out)
        lse = torch.where(no_keys[:, None, None], float("-inf"), lse)
    return out, lse


# Ulysses: trade the sequence split for a head split and back.


def heads_to_ranks(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """[B, S_local, H, D] each (same shape) -> [B, u * S_local, H / u, D] each, in one all-to-all.

    The received tokens are ordered by group rank, so Ulysses ranks must hold consecutive sequence shards.
    """
    world_size = dist.get_world_size(group)
    batch_size, local_len, num_heads, head_dim = tensors[0].shape
    if num_heads % world_size != 0:
        raise ValueError(f"Ulysses degree {world_size} must divide the local attention head count {num_heads}")
    local_heads = num_heads // world_size
    # send[j] holds head group j of every tensor: [u, N, B, S_local, H / u, D]
    send = torch.stack(
        [x.reshape(batch_size, local_len, world_size, local_heads, head_dim).permute(2, 0, 1, 3, 4) for x in tensors],
        dim=1,
    ).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] holds rank j's tokens of this rank's heads: concatenate the tokens in rank order
    recv = recv.permute(1, 2, 0, 3, 4, 5).reshape(
        len(tensors), batch_size, world_size * local_len, local_heads, head_dim
    )
    return list(recv.unbind(0))


def ranks_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, u * S_local, H / u, D] -> [B, S_local, H, D]: the inverse of heads_to_ranks."""
    world_size = dist.get_world_size(group)
    batch_size, full_len, local_heads, head_dim = x.shape
    local_len = full_len // world_size
    send = x.reshape(batch_size, world_size, local_len, local_heads, head_dim).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] holds this rank's tokens of rank j's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(batch_size, local_len, world_size * local_heads, head_dim)


def _scatter_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V travel in one all-to-all when they have one shape (self-attention), else one each."""
    if query.shape == key.shape == value.shape:
        query, key, value = heads_to_ranks([query, key, value], group)
    else:
        query, key, value = (heads_to_ranks([x], group)[0] for x in (query, key, value))
    return query, key, value


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenates each rank's [B, S_local, ...] along the sequence, in group rank order.

    A bool tensor (a key padding mask) travels as uint8: compiled (`--compile`), inductor's CPU code takes
    the bool that a traced all_gather returns for an int64 and fails to build the `where` that uses it.
    """
    sent = x.to(torch.uint8) if x.dtype == torch.bool else x
    parts = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, sent.contiguous(), group=group)
    gathered = torch.cat(parts, dim=1)
    return gathered.bool() if x.dtype == torch.bool else gathered


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup | None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence with H / u heads per rank; the group size must divide H."""
    if _group_size(group) == 1:
        return attention_with_lse(query, key, value, key_padding_mask)[0]
    query, key, value = _scatter_heads(query, key, value, group)
    if key_padding_mask is not None:
        key_padding_mask = _gather_sequence(key_padding_mask, group)
    out, _ = attention_with_lse(query, key, value, key_padding_mask)
    return ranks_to_heads(out, group)


# Ring: pass K/V blocks around the group and merge the partial results through their LSE.


def _start_ring_pass(
    tensors: list[torch.Tensor], send_to: int, recv_from: int, group: dist.ProcessGroup
) -> tuple[list[torch.Tensor], list[dist.Work]]:
    """Sends `tensors` to the next rank and receives the previous rank's, without waiting."""
    received = [torch.empty_like(x) for x in tensors]
    ops = []
    for tag, (outgoing, incoming) in enumerate(zip(tensors, received, strict=True)):
        ops.append(dist.P2POp(dist.isend, outgoing, send_to, group, tag))
        ops.append(dist.P2POp(dist.irecv, incoming, recv_from, group, tag))
    return received, dist.batch_isend_irecv(ops)


def _merge_block(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge in fp32: lse = logaddexp(lse, lse_i), out = sum_i exp(lse_i - lse) * out_i."""
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    # Rows with no real key so far stay at lse = -inf; subtract 0 there instead of -inf (which gives NaN).
    reference = torch.where(torch.isneginf(new_lse), 0.0, new_lse)
    out = torch.exp(lse - reference)[..., None] * out + torch.exp(block_lse - reference)[..., None] * block_out
    return out, new_lse


def _with_context(
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    context: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The context's keys and values before the block's along the sequence, and their padding masks joined."""
    if context is None:
        return key, value, key_padding_mask
    context_key, context_value, context_mask = context
    mask = None
    if context_mask is not None or key_padding_mask is not None:
        batch_size, device = key.shape[0], key.device
        if context_mask is None:
            context_mask = torch.zeros(batch_size, context_key.shape[1], dtype=torch.bool, device=device)
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(batch_size, key.shape[1], dtype=torch.bool, device=device)
        mask = torch.cat([context_mask.to(torch.bool), key_padding_mask], dim=1)
    return torch.cat([context_key, key], dim=1), torch.cat([context_value, value], dim=1), mask


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup | None,
    key_padding_mask: torch.Tensor | None = None,
    context: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Attention of the local queries over every rank's keys, one K/V block per hop.

    The next hop's transfer is started before the block in hand is computed, so that communication
    overlaps compute. key_padding_mask must be given on every rank of the group or on none.
    `context` = (key, value, key_padding_mask or None) holds keys that every rank has whole: they stay
    local and are attended on the first hop, together with the rank's own block, so each counts once.
    """
    world_size = _group_size(group)
    if world_size == 1:
        return attention_with_lse(query, *_with_context(key, value, key_padding_mask, context))[0]
    rank = dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % world_size)
    recv_from = dist.get_global_rank(group, (rank - 1) % world_size)

    # Point-to-point sends need contiguous tensors; the received blocks are.
    block = [key, value] if key_padding_mask is None else [key, value, key_padding_mask]
    block = [x.contiguous() for x in block]
    out, lse = None, None
    for hop in range(world_size):
        if hop + 1 < world_size:
            next_block, requests = _start_ring_pass(block, send_to, recv_from, group)
        block_mask = block[2] if key_padding_mask is not None else None
        block_key, block_value = block[0], block[1]
        if hop == 0:
            block_key, block_value, block_mask = _with_context(block_key, block_value, block_mask, context)
        block_out, block_lse = attention_with_lse(query, block_key, block_value, block_mask)
        out, lse = _merge_block(out, lse, block_out, block_lse)
        if hop + 1 < world_size:
            for request in requests:
                request.wait()
            block = next_block
    assert out is not None  # world_size > 1: the loop ran
    return out.to(query.dtype)


def usp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses inside the ring: heads are split over `ulysses_group`, K/V blocks travel over `ring_group`.

    The local shard of rank (ring r, ulysses u) must be sequence shard r * ulysses_size + u, so that the
    Ulysses all-to-all assembles each ring rank's contiguous chunk; either group may be None or of size 1.
    """
    use_ulysses = _group_size(ulysses_group) > 1
    if use_ulysses:
        query, key, value = _scatter_heads(query, key, value, ulysses_group)
        if key_padding_mask is not None:
            key_padding_mask = _gather_sequence(key_padding_mask, ulysses_group)
    out = ring_attention(query, key, value, ring_group, key_padding_mask)
    if use_ulysses:
        out = ranks_to_heads(out, ulysses_group)
    return out


def joint_usp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_query: torch.Tensor,
    context_key: torch.Tensor,
    context_value: torch.Tensor,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    key_padding_mask: torch.Tensor | None = None,
    context_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint attention over [context, sequence]: the sequence split as for usp_attention, the context whole.

    query/key/value [B, S_local, H, D] are this rank's shard of the split sequence (shard order as for
    usp_attention); context_query/key/value [B, T, H, D] are the same on every rank. Every query, of
    the context and of the shard, attends to every key: the context's and the whole sequence's.
    context_padding_mask [B, T] (True = padded, or None) masks context keys. Returns (context output
    [B, T, H, D], the same on every rank up to rounding; shard output [B, S_local, H, D]).
    """
    ulysses_size = _group_size(ulysses_group)
    num_heads = query.shape[2]
    if ulysses_size > 1:
        query, key, value = _scatter_heads(query, key, value, ulysses_group)
        if key_padding_mask is not None:
            key_padding_mask = _gather_sequence(key_padding_mask, ulysses_group)
        local_heads = num_heads // ulysses_size
        first = dist.get_rank(ulysses_group) * local_heads
        context_query, context_key, context_value = (
            x.narrow(2, first, local_heads) for x in (context_query, context_key, context_value)
        )
    context_len = context_query.shape[1]
    joint_query = torch.cat([context_query, query], dim=1)
    context = (context_key, context_value, context_padding_mask)
    out = ring_attention(joint_query, key, value, ring_group, key_padding_mask, context)
    context_out, out = out[:, :context_len], out[:, context_len:]
    if ulysses_size > 1:
        out = ranks_to_heads(out.contiguous(), ulysses_group)
        # Every rank computed the context's tokens for its heads: gather the heads back, in rank order.
        parts = [torch.empty_like(context_out) for _ in range(ulysses_size)]
        dist.all_gather(parts, context_out.contiguous(), group=ulysses_group)
        context_out = torch.cat(parts, dim=2)
    return context_out, out
