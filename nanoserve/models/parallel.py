"""Tensor parallelism's model side: which dimension of each parameter the ranks split, this
rank's part of a full (TP=1) tensor, and the vocabulary-parallel embedding.

Column-parallel (output rows split, no communication): qkv_proj (each rank its q heads, its k
heads and its v heads, bias too), gate_up_proj (its gate rows and its up rows; each expert's
too), embed_tokens and lm_head (its rows of the vocabulary). Row-parallel (input columns
split, outputs summed by `all_reduce`): o_proj, down_proj (each expert's too). The rest (norms,
the MoE router) is replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.distributed.parallel_state import all_reduce, shard_padded, tp_rank, tp_size
from nanoserve.models.layers import MergedLinear
from nanoserve.models.moe import Experts
from nanoserve.quant.linear import QuantizedLinear

# parameter name ending -> the dimension the ranks split, counted from the end (so that a
# checkpoint's per-expert tensor and the stacked parameter agree)
SPLIT_DIMS = {
    "qkv_proj.weight": -2, "qkv_proj.bias": -1, "gate_up_proj.weight": -2,
    "experts.gate_up_proj": -2, "embed_tokens.weight": -2, "lm_head.weight": -2,
    "o_proj.weight": -1, "down_proj.weight": -1, "experts.down_proj": -1,
}


def split_dim(param: str) -> int | None:
    """The dimension of `param` that the ranks split; None when every rank holds all of it."""
    return next((dim for end, dim in SPLIT_DIMS.items() if param.endswith(end)), None)


def module_split_dim(param: str, module: nn.Module) -> int | None:
    """split_dim, or a quantized layer's own for its tensor (QuantizedLinear.tp_dim)."""
    if isinstance(module, QuantizedLinear):
        return module.tp_dim(param.rsplit(".", 1)[1])
    return split_dim(param)


def _fused(param: str, module: nn.Module) -> bool:
    return isinstance(module, MergedLinear) or \
        (isinstance(module, Experts) and param.endswith("gate_up_proj"))


def rank_part(param: str, module: nn.Module, shard_index: int | None, ndim: int
              ) -> tuple[int, list[tuple[slice, ...]]] | None:
    """(dim, indices): the indices into a full (TP=1) `ndim`-dimensional tensor of `param`
    whose results, concatenated along dim, are this rank's part of it. The tensor is shard
    `shard_index` of a fused projection (a checkpoint's k_proj), or all of it when None (then
    a fused one holds this rank's rows of each shard: its q, k and v heads). None: the whole
    tensor (a replicated parameter, or TP=1)."""
    if tp_size() == 1:
        return None
    dim = module_split_dim(param, module)
    if dim is None:
        return None
    rank, size = tp_rank(), tp_size()
    if isinstance(module, QuantizedLinear):  # a checkpoint's shard tensor, each its own layout
        assert shard_index is not None or len(module.shard_sizes) == 1, param
        n = module.shard_view(param.rsplit(".", 1)[1], shard_index or 0).shape[dim]
        pieces = [(rank * n, n)]
    elif _fused(param, module):
        local = module.shard_sizes  # this rank's rows of each shard
        shards = range(len(local)) if shard_index is None else [shard_index]
        pieces = [((size * sum(local[:i]) if shard_index is None else 0) + rank * local[i],
                   local[i]) for i in shards]
    else:
        n = getattr(module, param.rsplit(".", 1)[1]).shape[dim]
        pieces = [(rank * n, n)]
    lead = (slice(None),) * (ndim + dim)
    return dim, [(*lead, slice(start, start + n)) for start, n in pieces]


def read_rank_part(src: Any, ndim: int, param: str, module: nn.Module,
                   shard_index: int | None = None) -> torch.Tensor:
    """This rank's part of the full tensor `src` (a tensor, or a safetensors slice, which
    reads only the indexed part from disk); see rank_part."""
    part = rank_part(param, module, shard_index, ndim)
    if part is None:
        return src[(slice(None),) * ndim]
    dim, indices = part
    pieces = [src[index] for index in indices]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def copy_rank_part(dst: torch.Tensor, part: torch.Tensor, param: str) -> None:
    """Fills `dst` with `part`; the last rank's vocabulary rows past the vocabulary (padding)
    are zeros; a tensor of another shape but as many elements (a per-tensor scale stored as
    [1] for a scalar) is reshaped."""
    if part.shape == dst.shape:
        dst.copy_(part)
        return
    if split_dim(param) is None and part.numel() == dst.numel():  # a scale stored as [1]
        dst.copy_(part.reshape(dst.shape))
        return
    dim = split_dim(param)
    dst.zero_()
    dst.narrow(dim, 0, part.shape[dim]).copy_(part)


def full_shape(param: str, local: torch.Size) -> tuple[int, ...]:
    """The TP=1 shape of a parameter whose local shape is `local` (the vocabulary padded to a
    multiple of the TP size: a model whose vocabulary does not divide gets other dummy
    weights under TP than at TP=1)."""
    dim = split_dim(param)
    shape = list(local)
    if dim is not None:
        shape[dim] *= tp_size()
    return tuple(shape)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the vocabulary (padded to a multiple of the TP size; the padding rows
    are zeros and no id reaches them): an id outside them embeds to zeros, and the sum over
    the ranks (exact: one non-zero term) is the full embedding. Split rather than replicated:
    a tied lm_head needs these rows anyway, and a replicated table would cost every rank
    vocab x hidden (1.2 GB for Qwen3-8B in bf16) to save one all-reduce of [tokens, hidden] a
    step, next to two a layer."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        start, n = shard_padded(vocab_size)
        super().__init__(n, hidden_size)
        self.vocab_start, self.tp = start, tp_size()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))
