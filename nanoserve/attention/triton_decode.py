"""Split-KV (flash-decoding) paged attention for decode, in Triton.

Stage 1: program (sequence b, kv head h, split s) reads its share of b's KV tiles once and
computes attention for all query heads of h's GQA group at once (one tl.dot per tile), writing
an unnormalized-free partial output and its log-sum-exp. Stage 2 merges the splits; with one
split (large batches) stage 1 writes the output itself and there is no stage 2. The split
count depends only on the batch size, so a captured graph stays valid for any context length.

FP8 KV (kv/fp8.py) is read as stored and dequantized in registers: e4m3 values convert exactly
to the query's dtype, and each token's scale multiplies, in float32, its column of q.k (K) and
its column of the probabilities before the p.V dot (V): a tile's [group, tokens] products
([tokens, group] when transposed, below), not its [tokens, head_dim] values. With float16
dots (Tiles.f16_dot) the V scales are taken relative to the tile's largest, which multiplies
the tile's p.V product instead, so a small scale never pushes p * scale into float16's
subnormals. V is converted while its tile is in
registers and only then goes to shared memory for the dot: converted after the shared-memory
load instead (where Triton puts an elementwise conversion by default), 8-bit V read transposed
for p.V comes one byte per load with bank conflicts, which made FP8 as slow as bf16.

Transposed dots (Tiles.transposed): scores as K.q^T [tokens, group] and the accumulator as
V^T.p [head_dim, group] rather than q.K^T [group, tokens] and p.V [group, head_dim]. The group
(4 query heads on Qwen3-8B) is then an MMA's N side, padded to 8, not its M side, padded to 16:
half the tensor-core work and fewer instructions around it. Compiled for sm_90 (triton 3.6.0),
the loop over 128-token FP8 tiles with float16 dots is 1,009 SASS instructions per warp per
tile against 1,296 (padded to 16 instead, the transposed form takes wgmma and 1,230), which is
what counts if the kernel is issue-bound, as FP8 at 1 x 128K (1.76x its memory floor) looks.
Measured on an H200 (tools/tune_decode.py): FP8 1 x 128K 106.3 us against 115.2, 1 x 32K 34.9
against 38.4, 64 x 512 37.0 against 40.2. bf16's 64-token loop gains little (423 instructions
against 442; its V tiles are then loaded through registers, not copied to shared memory
asynchronously): with TMA tiles at 64 x 512, 34.9 us against 35.7, so batched bf16 takes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanoserve import pdl
from nanoserve.attention import cuda_fp8_decode

BLOCK_N = 64  # the tile that bounds the split count (num_splits_for)


_MERGE_SPLITS = 16  # splits the merge kernel reads a step: one compiled merge for every count


class Tiles(NamedTuple):
    """Stage 1's launch settings: KV tokens per tile, warps, pipeline stages; for FP8 KV
    whether the dots run in float16 (e4m3 converts to float16 in one instruction, to bfloat16
    not; q and the probabilities are rounded to float16 then, not to the model's dtype); and
    how many times the caller's split count (num_splits_for) to launch; whether K/V tiles are
    read through TMA tensor descriptors (each tile lies in one page, page_size % block_n == 0,
    so it is one box of the cache, copied to shared memory asynchronously); whether the dots
    are computed transposed, the group on the MMA's N side (module docstring)."""
    block_n: int
    num_warps: int
    num_stages: int
    f16_dot: bool = False
    split_factor: int = 1
    tma: bool = False  # K/V tiles through TMA descriptors (async copies to shared memory)
    transposed: bool = False  # scores [tokens, group], accumulator [head_dim, group]
    # FP8 with splits: the CUDA kernel (cuda_fp8_decode.py) where it builds, num_stages
    # tiles deep, cuda_split_factor times the caller's split count; Triton's where it does not
    cuda: bool = False
    cuda_split_factor: float = 0.25


# per stored KV dtype, measured on an H200 by tools/tune_decode.py in CUDA graphs (Qwen3-8B
# shape, one layer): bf16 KV is best at 64-token tiles at every shape (1 x 32K 40.1 us, 1.26x
# its floor; 1 x 128K 129.5 us, 1.02x); above SMALL_BATCH its tiles come through TMA (64 x 512,
# one split: 35.3 us against 36.6). FP8 wants 128-token tiles, float16 dots (e4m3 converts to
# float16 in one instruction per pair, to bfloat16 in three) and at small batches twice the
# splits: 1 x 32K 41.0 us, 1 x 128K 128.7 us (bfloat16 dots: 46.0, 150.5), 64 x 512 40.8 us
# with one split; "fp8-batched" takes over above SMALL_BATCH, a threshold between the measured
# points. TMA made FP8 slower (143.4 us against 139.4 at 128K, bfloat16 dots). Transposed
# dots: FP8 and batched bf16 (module docstring). At small batches FP8 runs the CUDA kernel,
# 3 tiles deep (session 19, 1 x 128K: 107.9 us against Triton's 111.3; 1 x 1M: 724.7 against
# 774.3; 64 x 512, equal, stays Triton's); Triton's takes 3 stages too where it runs instead.
# The CUDA kernel's blocks take four times num_splits_for's tokens, one wave of one block an
# SM: they start less often (each reads its page numbers and q and fills its pipeline first).
# Session 25, H200, whole-row copies, one layer: 1 x 128K 71.2 us at x0.25 (16 splits, 128
# blocks) against 75.1 at x0.5; 1 x 1M 516.9 against 557.9. Rounded up, x0.25 gave 17 splits
# (136 blocks on 132 SMs): the engine's TPOT at 128K was 7.85 ms against 7.10 at x0.5.
# Sessions 32-33 (H200): 128-token tiles for a GQA group of 8 (Qwen3-30B-A3B's 32 query heads
# over 4) took 7.1 us against 8.0 at 1 x 4K in tools/tune_decode.py, but the engine's TPOT did
# not move (2.94, 2.95 ms against 2.95, 2.90 alternating): 64 stays.
TILES = {"default": Tiles(64, 4, 2),
         "batched": Tiles(64, 4, 2, tma=True, transposed=True),
         "fp8": Tiles(128, 4, 3, f16_dot=True, split_factor=2, transposed=True, cuda=True),
         "fp8-batched": Tiles(128, 4, 2, f16_dot=True, transposed=True)}
SMALL_BATCH = 8


def warm_decode(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                kv_dtype: torch.dtype, device: torch.device) -> None:
    """Builds (up to a minute, once per machine) and runs once the decode kernel compiled
    outside Triton, FP8's CUDA kernel, for this model's shape: at start, not in a request, and
    not first loaded while a CUDA graph captures."""
    if device.type != "cuda" or kv_dtype.itemsize != 1 or not TILES["fp8"].cuda:
        return
    k = torch.zeros(2, 256, num_kv_heads, head_dim, dtype=kv_dtype, device=device)
    scales = torch.ones(2, 256, num_kv_heads, device=device)
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    table = torch.ones(1, 1, dtype=torch.int32, device=device)
    lens = torch.full((1,), 256, dtype=torch.int32, device=device)
    # 4 splits: the CUDA kernel's share of them is 2, never the one split Triton writes directly
    paged_decode_attention(q, k, k, table, lens, 1.0, 4, k_scale=scales, v_scale=scales)
    torch.cuda.synchronize(device)


def default_tiles(scaled: bool, batch: int, page_size: int = 256, head_dim: int = 128) -> Tiles:
    """The measured tiles for the KV dtype and batch; TMA only where a tile is one box of a
    page (page_size a multiple of the tile) and head_dim a power of two."""
    small = batch <= SMALL_BATCH
    tiles = TILES[("fp8" if small else "fp8-batched") if scaled else
                  ("default" if small else "batched")]
    if tiles.tma and (page_size % tiles.block_n or head_dim & (head_dim - 1)):
        # bf16's transposed form was measured with TMA tiles only
        tiles = tiles._replace(tma=False, transposed=tiles.transposed and scaled)
    return tiles


@triton.jit
def _per_head(x, TRANSPOSED: tl.constexpr):
    """x, one value per head of the group, broadcastable against the scores [G, N] and the
    accumulator [G, D], or against their transposes [N, G] and [D, G]."""
    return tl.expand_dims(x, 0 if TRANSPOSED else 1)


@triton.jit
def _per_token(x, TRANSPOSED: tl.constexpr):
    """x, one value per token of the scores (or per element of head_dim of the accumulator,
    which lies on the same axis), broadcastable against them or their transposes."""
    return tl.expand_dims(x, 1 if TRANSPOSED else 0)


# What differs between a decode graph's buffers and an eager step's tensors is left
# unspecialized, so that one compiled kernel serves both: the split count (a function of the
# batch size: num_splits_for) with the strides that scale with it, and the page table's width.
# The eager decode rows of mixed steps come in any number and width; as specialized values each
# new one compiled kernels inside a request (20 of them, about 4 s, in a 32 x 4,096 prefill).
# The outputs' strides were specialized again for a while (session 23's review, for vectorized
# stores): from then on an offloaded Qwen3-8B at 32K with the CPU attending a share decoded
# other tokens than the resident engine (tests/test_gpu_cpu_share.py, bisected on an H200 in
# session 24); unspecialized, it equals the resident engine.
_SPLIT_ARGS = ["num_splits", "stride_mob", "stride_moh", "stride_mlb", "stride_mlh"]


@triton.jit(do_not_specialize=_SPLIT_ARGS + ["stride_pt"])
def _decode_split_kernel(
    Q, K, V, KDesc, VDesc, KScale, VScale, PageTable, ContextLens, Starts, MidO, MidLse, scale,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_sp, stride_st, stride_sh,
    stride_pt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SCALED: tl.constexpr, F16_DOT: tl.constexpr, TMA: tl.constexpr,
    IN_PAGE: tl.constexpr, DIRECT: tl.constexpr, TRANSPOSED: tl.constexpr,
    HAS_STARTS: tl.constexpr, PDL: tl.constexpr,
):
    pdl.wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx_len = tl.load(ContextLens + b)
    # HAS_STARTS: the row attends tokens [start, ctx_len) (the CPU took those before)
    start = tl.load(Starts + b) if HAS_STARTS else 0
    num_tiles = tl.cdiv(ctx_len, BLOCK_N)
    first_tile = start // BLOCK_N
    per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_lo = first_tile + s * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if F16_DOT:
        q = q.to(tl.float16)

    # scores [G, N] and accumulator [G, D], or transposed [N, G] and [D, G] (module docstring)
    TOKEN_AXIS: tl.constexpr = 0 if TRANSPOSED else 1
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    if TRANSPOSED:
        acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    page_row = PageTable + b.to(tl.int64) * stride_pt
    for t in range(tile_lo, tile_hi):
        tok = t * BLOCK_N + offs_n
        n_mask = (tok < ctx_len) & (tok >= start)
        if TMA:  # the tile is one box of its page; rows past ctx_len are read, then masked
            first = (t * BLOCK_N) % PAGE_SIZE
            page_id = tl.load(page_row + (t * BLOCK_N) // PAGE_SIZE)
            k = KDesc.load([page_id, first, kvh, 0]).reshape(BLOCK_N, BLOCK_D)
            v = VDesc.load([page_id, first, kvh, 0]).reshape(BLOCK_N, BLOCK_D)
            if not SCALED:  # no NaN bytes into p.V (FP8's rows are zeroed after conversion)
                v = tl.where(n_mask[:, None], v, tl.zeros_like(v))
            page = tl.full([BLOCK_N], page_id, tl.int64)
            slot = first + offs_n
        elif IN_PAGE:  # one page id and one base address per tile; rows past ctx_len are
            # read (the page holds them), then masked: K's scores, V's rows (see below)
            first = (t * BLOCK_N) % PAGE_SIZE
            page = tl.load(page_row + (t * BLOCK_N) // PAGE_SIZE).to(tl.int64)
            slot = first + offs_n
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k_at = K + page * stride_kp + kvh * stride_kh + slot[:, None] * stride_kt \
                + offs_d[None, :]
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_at)
            else:
                k = tl.load(k_at, mask=d_mask[None, :], other=0.0)
        else:
            page = tl.load(page_row + tok // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot = tok % PAGE_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(K + page[:, None] * stride_kp + slot[:, None] * stride_kt
                        + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        # k.to(q.dtype): exact for e4m3; a no-op when the cache holds the model's dtype
        if TRANSPOSED:
            qk = tl.dot(k.to(q.dtype), tl.trans(q), input_precision=PRECISION)
        else:
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        if SCALED:
            scale_at = page * stride_sp + slot * stride_st + kvh * stride_sh
            k_scale = tl.load(KScale + scale_at, mask=n_mask, other=0.0)
            qk = qk * _per_token(k_scale * scale, TRANSPOSED)
        else:
            qk = qk * scale
        qk = tl.where(_per_token(n_mask, TRANSPOSED), qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, TOKEN_AXIS))
        alpha = tl.exp(m - m_new)
        p = tl.exp(qk - _per_head(m_new, TRANSPOSED))
        l_sum = l_sum * alpha + tl.sum(p, TOKEN_AXIS)
        if IN_PAGE and SCALED and BLOCK_D == HEAD_DIM:  # rows past ctx_len: zeroed below
            v = tl.load(V + page * stride_vp + kvh * stride_vh + slot[:, None] * stride_vt
                        + offs_d[None, :])
        elif IN_PAGE:  # masked: their bytes may be NaNs
            v = tl.load(V + page * stride_vp + kvh * stride_vh + slot[:, None] * stride_vt
                        + offs_d[None, :], mask=kv_mask, other=0.0)
        elif not TMA:
            v = tl.load(V + page[:, None] * stride_vp + slot[:, None] * stride_vt
                        + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        if SCALED:  # converted in registers, rows past ctx_len zeroed: the select keeps
            # Triton from moving the conversion after the shared-memory load (module docstring)
            v = tl.where(n_mask[:, None], v.to(q.dtype), tl.zeros_like(v.to(q.dtype)))
            # each token's V scale, folded into its column of the probabilities
            v_scale = tl.load(VScale + scale_at, mask=n_mask, other=0.0)
            if F16_DOT:  # relative to the tile's largest: p * scale stays in float16's range
                v_max = tl.max(v_scale, 0)
                p = p * _per_token(v_scale / v_max, TRANSPOSED)
            else:
                p = p * _per_token(v_scale, TRANSPOSED)
        if TRANSPOSED:
            pv = tl.dot(tl.trans(v.to(q.dtype)), p.to(q.dtype), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        if SCALED and F16_DOT:
            pv = pv * v_max
        acc = acc * _per_head(alpha, TRANSPOSED) + pv
        m = m_new

    pdl.let_next_start(PDL)
    has_work = tile_hi > tile_lo
    safe_l = tl.where(l_sum > 0, l_sum, 1.0)
    out = tl.where(has_work, acc / _per_head(safe_l, TRANSPOSED), 0.0)
    lse = tl.where(has_work, m + tl.log(safe_l), float("-inf"))
    # DIRECT (one split): MidO is the output itself, in its dtype; no log-sum-exp, no merge
    tl.store(MidO + b * stride_mob + _per_head(heads, TRANSPOSED) * stride_moh
             + s * stride_mos + _per_token(offs_d, TRANSPOSED), out.to(MidO.dtype.element_ty),
             mask=_per_head(g_mask, TRANSPOSED) & _per_token(d_mask, TRANSPOSED))
    if not DIRECT:
        tl.store(MidLse + b * stride_mlb + heads * stride_mlh + s, lse, mask=g_mask)


@triton.jit(do_not_specialize=_SPLIT_ARGS)
def _merge_splits_kernel(
    MidO, MidLse, ExtraO, ExtraLse, Out,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, EXTRA: tl.constexpr,
    PDL: tl.constexpr,
):
    """The splits BLOCK_S at a time, each step's weights rescaled to the running maximum of
    the log-sum-exps. EXTRA: one more partial, contiguous [batch, heads, d] float32 and
    [batch, heads] (the CPU's share of the row's tokens)."""
    pdl.start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([], float("-inf"), tl.float32)
    w_sum = tl.zeros([], tl.float32)
    o_sum = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < num_splits
        lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask,
                      other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - safe_m)
        w = tl.exp(lse - safe_m)
        o = tl.load(MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos
                    + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        o_sum = o_sum * rescale + tl.sum(o * w[:, None], 0)
        w_sum = w_sum * rescale + tl.sum(w, 0)
        m = m_new
    if EXTRA:
        heads = tl.num_programs(1)
        x_lse = tl.load(ExtraLse + b * heads + h)
        m_new = tl.maximum(m, x_lse)
        safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - safe_m)
        x_w = tl.exp(x_lse - safe_m)
        x_o = tl.load(ExtraO + (b * heads + h) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        o_sum = o_sum * rescale + x_o * x_w
        w_sum = w_sum * rescale + x_w
    out = o_sum / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty),
             mask=d_mask)


def num_splits_for(batch: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """About 4 waves of programs over the SMs, never more (one split when batch x kv heads
    fill them: at 64 x 512, Qwen3-8B's shape on an H200, 1 split takes 36.8 us against 41.7
    for 2, the merge kernel gone), never more splits than tiles at max_len."""
    want = (4 * num_sms) // (batch * num_kv_heads)
    return max(1, min(want, 128, triton.cdiv(max_len, BLOCK_N)))


class Partials(NamedTuple):
    """Stage 1's per-split results, before the merge: outputs [batch, heads, splits, d] and
    log-sum-exps [batch, heads, splits], float32."""
    o: torch.Tensor
    lse: torch.Tensor


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int, out: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           tiles: Tiles | None = None) -> torch.Tensor:
    """q: [batch, heads, d]; caches: [pages, page_size, kv_heads, d]; page_tables: [batch, n]
    int32; context_lens: [batch] int32 (>= 1 for every row); FP8 caches come with their scales
    [pages, page_size, kv_heads] (K's and V's share strides). Returns [batch, heads, d]."""
    if out is None:
        out = torch.empty_like(q)
    parts = _stage1(q, k_cache, v_cache, page_tables, context_lens, scale, num_splits, out,
                    k_scale, v_scale, tiles, None)
    if parts is None:  # one split: stage 1 wrote the output
        return out
    return merge_partials(parts, out)


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    num_splits: int, starts: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    tiles: Tiles | None = None) -> Partials:
    """Stage 1 over each row's tokens [starts, context_lens) (starts int32 [batch]), left
    unmerged: merge_partials merges them with another share of the same rows."""
    return _stage1(q, k_cache, v_cache, page_tables, context_lens, scale, num_splits, None,
                   k_scale, v_scale, tiles, starts)


def _stage1(q, k_cache, v_cache, page_tables, context_lens, scale, num_splits, out, k_scale,
            v_scale, tiles, starts) -> Partials | None:
    """out given and one split: written directly, None returned."""
    batch, heads, d = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    scaled = k_scale is not None
    tiles = tiles or default_tiles(scaled, batch, page_size, d)
    if q.dtype == torch.float32:  # float32 dots (references, tests): 64-token tiles keep their
        # operands within sm86 / sm89's 99 KB of shared memory (128 took 147 KB with a group of 8)
        tiles = tiles._replace(block_n=min(tiles.block_n, 64))
    cuda = scaled and tiles.cuda and cuda_fp8_decode.available(q, k_cache, page_size)
    if cuda:
        num_splits = cuda_fp8_decode.num_splits(num_splits, tiles.cuda_split_factor)
    else:
        num_splits *= tiles.split_factor
    if scaled:
        assert k_scale.stride() == v_scale.stride()
    else:  # never read: the unscaled kernel has no scale loads
        k_scale = v_scale = k_cache
    if tiles.tma:
        assert page_size % tiles.block_n == 0 and d == triton.next_power_of_2(d)
        box = [1, tiles.block_n, 1, d]
        k_desc, v_desc = (TensorDescriptor(c, list(c.shape), list(c.stride()), box)
                          for c in (k_cache, v_cache))
    else:  # never read
        k_desc = v_desc = k_cache
    direct = num_splits == 1 and out is not None  # writes the output: no merge kernel
    mid_o = out.unsqueeze(2) if direct else \
        torch.empty(batch, heads, num_splits, d, dtype=torch.float32, device=q.device)
    # one split stores no log-sum-exp: nothing to allocate
    mid_lse = mid_o if direct else \
        torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    if cuda:  # (never direct: at least 2 splits)
        cuda_fp8_decode.decode_partials(q, k_cache, v_cache, k_scale, v_scale, page_tables,
                                        context_lens, scale, starts, mid_o, mid_lse,
                                        stages=tiles.num_stages)
        return Partials(mid_o, mid_lse)
    block_d = triton.next_power_of_2(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    f16_dot = scaled and tiles.f16_dot and q.dtype != torch.float32  # float32 q: float32 dots
    scale_strides = k_scale.stride()[:3] if scaled else (0, 0, 0)
    # the group is padded to an MMA's N (8) when transposed, to its M (16) otherwise
    block_g = max(8 if tiles.transposed else 16, triton.next_power_of_2(group))
    pdl_args = pdl.launch_args(q)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, k_desc, v_desc, k_scale, v_scale, page_tables, context_lens,
        starts if starts is not None else context_lens, mid_o, mid_lse, scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        page_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), num_splits,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=d,
        BLOCK_D=block_d, PAGE_SIZE=page_size, BLOCK_N=tiles.block_n,
        PRECISION=precision, SCALED=scaled, F16_DOT=f16_dot, TMA=tiles.tma,
        IN_PAGE=not tiles.tma and page_size % tiles.block_n == 0, DIRECT=direct,
        TRANSPOSED=tiles.transposed, HAS_STARTS=starts is not None,
        **pdl_args, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return None if direct else Partials(mid_o, mid_lse)


def merge_partials(parts: Partials, out: torch.Tensor,
                   extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Stage 2: the splits merged by their log-sum-exps into out [batch, heads, d], with
    `extra` (output [batch, heads, d] and LSE [batch, heads], float32, contiguous: the CPU's
    share of the same rows) merged in too."""
    mid_o, mid_lse = parts
    batch, heads, num_splits, d = mid_o.shape
    x_o, x_lse = extra if extra is not None else (mid_o, mid_lse)  # never read without
    if extra is not None:
        assert x_o.is_contiguous() and x_lse.is_contiguous() and x_o.dtype == torch.float32
    pdl_args = pdl.launch_args(out)
    _merge_splits_kernel[(batch, heads)](
        mid_o, mid_lse, x_o, x_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=_MERGE_SPLITS,
        EXTRA=extra is not None, **pdl_args, num_warps=4,
    )
    return out
