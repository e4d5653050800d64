"""Fused MoE experts in Triton, in the manner of vLLM's and SGLang's fused_moe: the (token, slot)
pairs are sorted by expert and padded to whole tiles on the device, then two grouped GEMMs run
over the stacked weights, each tile of rows belonging to one expert:
- gate_up, with SiLU-multiply in its epilogue: a program computes the same columns of an
  expert's gate rows and up rows and writes silu(gate) * up, so the intermediate [pairs, I] is
  written once and the [pairs, 2I] one of the unfused path never exists;
- down, with each pair's routing weight applied in its epilogue; the k weighted outputs of a
  token are then summed (`sum_slots`: one kernel, in fp32, rounded once).
One token (batch-1 decode) goes to models/cuda_moe.py's two CUDA kernels where they build and
are not switched off (NANOSERVE_ONE_ROW_CUDA=0): no sort and no sum kernel. The router's softmax,
top-k and renormalization run as one kernel too (`route`). No host
synchronization anywhere: the padded sizes are bounded by the pair count, so every launch has a
static grid and is captured in decode graphs; tiles past the used ones exit.

Each expert with tokens is read once per tile column, so at batch 1 a layer reads its k experts
(the HBM floor); at larger batches an expert's rows share its weights in one tile.

Tiles come per batch band from a config file per GPU (moe_configs/<device name>.json, written by
tools/tune_moe.py), else from `default_tiles`. The sort runs as one Triton program for decode's
pair counts (a dozen torch ops would cost more than the experts at batch 1) and as three kernels
over blocks of pairs for prefill's; sort_pairs_reference (torch ops) is the CPU's and the tests'
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanoserve import pdl
from nanoserve.models.moe_tiles import MoETiles, padded_sizes, sort_pairs_reference, tiles_for

ONE_PROGRAM_SORT_MAX = 1024  # pairs sorted by one Triton program; more: blocks of them


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sort_by_expert(Ids, Scratch, first, P, E, BLOCK: tl.constexpr):
    """Pairs first .. first + BLOCK - 1, sorted by expert with pairs in order within one: each
    sorted pair's expert (E past P), its index within the block, its rank among its expert's
    pairs, and whether it ends its expert's run. Scratch: this program's BLOCK + 2 ints (each
    pair's neighbours in sorted order pass through memory). The barrier inside orders every
    store the program made before the call before every one after it."""
    offs = tl.arange(0, BLOCK)
    live = first + offs < P
    expert = tl.load(Ids + first + offs, mask=live, other=0).to(tl.int32)
    key = tl.sort(tl.where(live, expert * BLOCK + offs, E * BLOCK + offs))
    expert, local = key // BLOCK, key % BLOCK
    tl.store(Scratch + 1 + offs, expert)
    tl.store(Scratch, -1)
    tl.store(Scratch + 1 + BLOCK, E + 1)
    tl.debug_barrier()
    before = tl.load(Scratch + offs)
    after = tl.load(Scratch + 2 + offs)
    rank = offs - tl.associative_scan(tl.where(expert != before, offs, 0), 0, _maximum)
    return expert, local, rank, expert != after


@triton.jit(do_not_specialize=["P", "ROWS", "TILES"])
def _sort_pairs_kernel(Ids, Scratch, SortedPairs, TileExpert, P, E, ROWS, TILES,
                       BLOCK_P: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                       BLOCK_TILES: tl.constexpr, BLOCK_M: tl.constexpr):
    # One program: the layout filled with padding, then each pair stored at its row
    rows = tl.arange(0, BLOCK_ROWS)
    tl.store(SortedPairs + rows, tl.zeros([BLOCK_ROWS], tl.int32) + P, mask=rows < ROWS)
    tiles = tl.arange(0, BLOCK_TILES)
    tl.store(TileExpert + tiles, tl.zeros([BLOCK_TILES], tl.int32) + E, mask=tiles < TILES)
    expert, pair, rank, run_end = _sort_by_expert(Ids, Scratch, 0, P, E, BLOCK_P)
    live = expert < E
    count = rank + 1
    # padding of the runs before each pair: each run's own, added at its last pair
    pad = tl.where(live & run_end, (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M - count, 0)
    dest = tl.arange(0, BLOCK_P) + tl.cumsum(pad, axis=0) - pad
    tl.store(SortedPairs + dest, pair, mask=live)
    tl.store(TileExpert + dest // BLOCK_M, expert, mask=live & (rank % BLOCK_M == 0))


# Beyond ONE_PROGRAM_SORT_MAX pairs (prefill), three kernels over blocks of SORT_BLOCK pairs:
# each block sorts its own pairs (as the one-program sort does) and counts them per expert;
# one program turns the counts into each (block, expert)'s first row; each block scatters its
# pairs there. Pairs stay in order within an expert, as in sort_pairs_reference. Every size
# runs on one compiled set (the torch ops it replaces cost 0.7 ms of host time a layer).
SORT_BLOCK = 1024
_BASES_CHUNK = 32  # blocks a step of the one-program scan


@triton.jit(do_not_specialize=["P", "ROWS", "TILES"])
def _block_ranks_kernel(Ids, Scratch, Counts, Ranks, SortedPairs, TileExpert, P, E, ROWS, TILES,
                        BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """A block's pairs: each one's rank among the block's pairs of its expert (Ranks, in pair
    order), the block's count per expert (Counts [blocks, E]); and the block's share of the
    layout filled with padding (SortedPairs P, TileExpert E), before the scatter writes it."""
    blk = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    experts = tl.arange(0, BLOCK_E)
    tl.store(Counts + blk * E + experts, tl.zeros([BLOCK_E], tl.int32), mask=experts < E)
    stride = tl.num_programs(0) * BLOCK
    for r in range(blk * BLOCK, ROWS, stride):
        tl.store(SortedPairs + r + offs, tl.zeros([BLOCK], tl.int32) + P, mask=r + offs < ROWS)
    for t in range(blk * BLOCK, TILES, stride):
        tl.store(TileExpert + t + offs, tl.zeros([BLOCK], tl.int32) + E, mask=t + offs < TILES)
    expert, local, rank, run_end = _sort_by_expert(Ids, Scratch + blk * (BLOCK + 2),
                                                   blk * BLOCK, P, E, BLOCK)
    live = expert < E
    tl.store(Ranks + blk * BLOCK + local, rank, mask=live)
    tl.store(Counts + blk * E + expert, rank + 1, mask=live & run_end)


@triton.jit(do_not_specialize=["NUM_BLOCKS"])
def _expert_bases_kernel(Counts, Bases, ExpertStart, NUM_BLOCKS, E, BLOCK_M: tl.constexpr,
                         BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each expert's first row (its rows padded to whole tiles, experts in order)
    and each (block, expert)'s first row, Bases [blocks, E] (the blocks in order)."""
    experts = tl.arange(0, BLOCK_E)
    e_ok = experts < E
    rows = tl.arange(0, CHUNK)
    total = tl.zeros([BLOCK_E], tl.int32)
    for b in range(0, NUM_BLOCKS, CHUNK):
        ok = ((b + rows) < NUM_BLOCKS)[:, None] & e_ok[None, :]
        total += tl.sum(tl.load(Counts + (b + rows)[:, None] * E + experts[None, :], mask=ok,
                                other=0), axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    tl.store(ExpertStart + experts, start, mask=e_ok)
    carry = start
    for b in range(0, NUM_BLOCKS, CHUNK):
        ok = ((b + rows) < NUM_BLOCKS)[:, None] & e_ok[None, :]
        at = (b + rows)[:, None] * E + experts[None, :]
        c = tl.load(Counts + at, mask=ok, other=0)
        tl.store(Bases + at, tl.cumsum(c, axis=0) - c + carry[None, :], mask=ok)
        carry += tl.sum(c, axis=0)


@triton.jit(do_not_specialize=["P"])
def _scatter_pairs_kernel(Ids, Ranks, Bases, ExpertStart, SortedPairs, TileExpert, P, E,
                          BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    blk = tl.program_id(0)
    pair = blk * BLOCK + tl.arange(0, BLOCK)
    live = pair < P
    expert = tl.load(Ids + pair, mask=live, other=0).to(tl.int32)
    dest = tl.load(Bases + blk * E + expert, mask=live, other=0) + \
        tl.load(Ranks + pair, mask=live, other=0)
    tl.store(SortedPairs + dest, pair, mask=live)
    first = (dest - tl.load(ExpertStart + expert, mask=live, other=0)) % BLOCK_M == 0
    tl.store(TileExpert + dest // BLOCK_M, expert, mask=live & first)


def _sort_pairs_blocked(ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = ids.numel()
    rows, tiles = padded_sizes(pairs, num_experts, block_m)
    blocks = triton.cdiv(pairs, SORT_BLOCK)
    dev = ids.device
    i32 = dict(dtype=torch.int32, device=dev)
    scratch = torch.empty(blocks * (SORT_BLOCK + 2), **i32)
    counts = torch.empty(blocks, num_experts, **i32)
    ranks = torch.empty(pairs, **i32)
    bases = torch.empty(blocks, num_experts, **i32)
    expert_start = torch.empty(num_experts, **i32)
    sorted_pairs = torch.empty(rows, **i32)
    tile_expert = torch.empty(tiles, **i32)
    block_e = triton.next_power_of_2(num_experts)
    _block_ranks_kernel[(blocks,)](ids, scratch, counts, ranks, sorted_pairs, tile_expert, pairs,
                                   num_experts, rows, tiles, BLOCK=SORT_BLOCK, BLOCK_E=block_e,
                                   num_warps=8)
    _expert_bases_kernel[(1,)](counts, bases, expert_start, blocks, num_experts, BLOCK_M=block_m,
                               BLOCK_E=block_e, CHUNK=_BASES_CHUNK, num_warps=4)
    _scatter_pairs_kernel[(blocks,)](ids, ranks, bases, expert_start, sorted_pairs, tile_expert,
                                     pairs, num_experts, BLOCK=SORT_BLOCK, BLOCK_M=block_m,
                                     num_warps=4)
    return sorted_pairs, tile_expert


def sort_pairs(ids: torch.Tensor, num_experts: int, block_m: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """sort_pairs_reference's result on CUDA: one Triton program for up to
    ONE_PROGRAM_SORT_MAX pairs (decode), three kernels over blocks of pairs beyond."""
    pairs = ids.numel()
    if not ids.is_cuda:
        return sort_pairs_reference(ids, num_experts, block_m)
    if pairs > ONE_PROGRAM_SORT_MAX:
        return _sort_pairs_blocked(ids, num_experts, block_m)
    rows, tiles = padded_sizes(pairs, num_experts, block_m)
    block_p = triton.next_power_of_2(pairs)
    scratch = torch.empty(block_p + 2, dtype=torch.int32, device=ids.device)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=ids.device)
    _sort_pairs_kernel[(1,)](ids, scratch, sorted_pairs, tile_expert, pairs, num_experts, rows,
                             tiles, BLOCK_P=block_p, BLOCK_ROWS=triton.next_power_of_2(rows),
                             BLOCK_TILES=triton.next_power_of_2(tiles), BLOCK_M=block_m,
                             num_warps=4)
    return sorted_pairs, tile_expert


@triton.jit(do_not_specialize=["P"])  # one compile for every pair count of a tile band
def _moe_gemm_kernel(A, ADesc, B, BDesc, C, Weights, SortedPairs, TileExpert, BScale,
                     N, K, P, E, TOP_K, stride_am, stride_be, stride_bn, stride_cm,
                     stride_se, stride_sn, scale_rows, scale_cols,
                     GATE_UP: tl.constexpr, FP8_B: tl.constexpr, B_TMA: tl.constexpr,
                     SORTED_MID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """C[pair, n] for the rows of one tile (one expert) and BLOCK_N columns. GATE_UP: A is the
    tokens (row pair // TOP_K), B an expert's [2N, K] gate then up rows, C = silu(gate) * up,
    each rounded to C's dtype where torch's unfused path rounds. Else A is the intermediate
    (row pair), B an expert's [N, K] down rows, C = A B^T times the pair's routing weight.
    FP8_B: B is e4m3 with BScale [E, rows / scale_rows, K / scale_cols] its block scales; a K
    step lies within one block column (scale_cols % BLOCK_K == 0), its dot is scaled after.
    B_TMA: B's tiles come through BDesc, a TMA descriptor of B [E, rows, K] (bf16 / fp16).
    SORTED_MID: the intermediate's rows are the sorted rows, not the pairs (padding rows
    included, never stored): gate_up stores its tile's rows there, and down reads a tile's
    rows as one box of ADesc, a TMA descriptor of A [rows, K]."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile, col = pid // tiles_n, pid % tiles_n
    expert = tl.load(TileExpert + tile)
    if expert >= E:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    live = pair < P
    row = pair // TOP_K if GATE_UP else pair
    offs_n = col * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    a_at = A + row[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_at = B + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + \
        offs_k[:, None]
    if FP8_B:  # each output's row of the expert's block scales (gate's, and up's N rows on)
        s_at = BScale + expert.to(tl.int64) * stride_se + (offs_n // scale_rows) * stride_sn
        s_up_at = BScale + expert.to(tl.int64) * stride_se + \
            ((offs_n + N) // scale_rows) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k
        if SORTED_MID and not GATE_UP:
            a = ADesc.load([tile * BLOCK_M, k])
        else:
            a = tl.load(a_at, mask=live[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            b = BDesc.load([expert, col * BLOCK_N, k]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = tl.load(b_at, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8_B:
            s = tl.load(s_at + k // scale_cols, mask=n_ok, other=0.0)
            acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATE_UP:
            if B_TMA:
                up = BDesc.load([expert, N + col * BLOCK_N, k]).reshape(BLOCK_N, BLOCK_K).T
            else:
                up = tl.load(b_at + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :],
                             other=0.0)
            if FP8_B:
                s_up = tl.load(s_up_at + k // scale_cols, mask=n_ok, other=0.0)
                acc_up += tl.dot(a, up.to(a.dtype), input_precision=PRECISION) * s_up[None, :]
            else:
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_at += BLOCK_K
        b_at += BLOCK_K
    if GATE_UP:
        gate = acc.to(C.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(C.dtype.element_ty)
        out = silu * acc_up.to(C.dtype.element_ty)
    else:
        out = acc * tl.load(Weights + pair, mask=live, other=0.0).to(tl.float32)[:, None]
    c_row = offs_m if SORTED_MID and GATE_UP else pair
    c_at = C + c_row[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_at, out.to(C.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


def experts_fused(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, tiles: MoETiles | None = None,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  block: tuple[int, int] = (128, 128),
                  down_tiles: MoETiles | None = None) -> torch.Tensor:
    """The experts' weighted sum for tokens x [T, H] routed to ids [T, k] with weights [T, k]:
    gate_up [E, 2I, H] and down [E, H, I] stacked (moe.Experts). FP8 experts: e4m3 stacks
    with `scales` (gate_up's, down's) one per `block` (rows, columns), dequantized in the
    tiles (x is not quantized). `down_tiles`: down's own (block_m as `tiles`'), else
    `tiles`; down's tiles say whether the intermediate is in sorted order (sorted_mid, where
    down's weights come through TMA). One token in half precision, tiles not given: the CUDA
    kernels of models/cuda_moe.py where they build and are not switched off."""
    if tiles is None and ids.shape[0] == 1:
        from nanoserve.models import cuda_moe  # batch-1 decode: two kernels, no sort, no sum
        if cuda_moe.supports(x, weights, ids, gate_up, down, scales, block):
            return cuda_moe.experts(x, weights, ids, gate_up, down, scales, block)
    t, k = ids.shape
    num_experts, inter2, hidden = gate_up.shape
    inter = inter2 // 2
    pairs = t * k
    if tiles is None:
        tiles = tiles_for(pairs, num_experts, hidden, inter, x.device)
    down_tiles = down_tiles or tiles
    assert down_tiles.block_m == tiles.block_m, "one sort: one row tile"
    sorted_pairs, tile_expert = sort_pairs(ids, num_experts, tiles.block_m)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    flat_weights = weights.reshape(-1).contiguous()
    gate_up_scales, down_scales = scales if scales is not None else (gate_up, down)
    gemm = _GemmLaunch(x.dtype, sorted_pairs, tile_expert, flat_weights, pairs, num_experts, k,
                       scales is not None, block)
    gate_up_tiles, down_tiles = gemm.adapt(tiles), gemm.adapt(down_tiles)
    # TMA: half precision, rows of whole 16-byte units from 16-byte aligned stacks (else the
    # descriptor refuses them: the pointer loads run instead)
    tma = scales is None and x.dtype in (torch.bfloat16, torch.float16) and \
        hidden % 8 == 0 and inter % 8 == 0 and \
        all(w.data_ptr() % 16 == 0 for w in (gate_up, down))
    # the intermediate in sorted order (down reads its tiles through TMA) where down's weights
    # come through TMA
    sorted_mid = down_tiles.sorted_mid and down_tiles.tma and tma
    mid = torch.empty(sorted_pairs.numel() if sorted_mid else pairs, inter, dtype=x.dtype,
                      device=x.device)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    gemm.run(x, gate_up, gate_up_scales, mid, inter, hidden, gate_up_tiles, True, sorted_mid,
             gate_up_tiles.tma and tma)
    gemm.run(mid, down, down_scales, out, hidden, inter, down_tiles, False, sorted_mid,
             down_tiles.tma and tma)
    return sum_slots(out.view(t, k, hidden))


class _GemmLaunch:
    """What experts_fused's two grouped GEMMs share: the sorted layout, the routing weights,
    the format."""

    def __init__(self, dtype: torch.dtype, sorted_pairs: torch.Tensor, tile_expert: torch.Tensor,
                 weights: torch.Tensor, pairs: int, num_experts: int, top_k: int, fp8: bool,
                 block: tuple[int, int]) -> None:
        self.dtype, self.sorted_pairs, self.tile_expert = dtype, sorted_pairs, tile_expert
        self.weights, self.pairs, self.num_experts, self.top_k = weights, pairs, num_experts, top_k
        self.fp8, self.block = fp8, block

    def adapt(self, tiles: MoETiles) -> MoETiles:
        """The tiles for x's dtype and the weights' format: float32 (tiles measured in bf16;
        its operands take twice the shared memory) half the K step, two stages (within sm86 /
        sm89's 99 KB); FP8 a K step within one scale block."""
        if self.dtype == torch.float32:
            tiles = tiles._replace(block_k=max(16, tiles.block_k // 2),
                                   num_stages=min(tiles.num_stages, 2))
        if self.fp8:
            step = tiles.block_k
            while self.block[1] % step:
                step //= 2
            tiles = tiles._replace(block_k=step)
        return tiles

    def run(self, a: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, c: torch.Tensor,
            n: int, k: int, tiles: MoETiles, gate_up: bool, sorted_mid: bool, tma: bool) -> None:
        """c = one of the two GEMMs over a's rows (gate_up: the tokens; down: the
        intermediate) and the stacked weights b, b's tiles through TMA where `tma`."""
        b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()),
                                  [1, tiles.block_n, tiles.block_k]) if tma else b
        a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()),
                                  [tiles.block_m, tiles.block_k]) \
            if sorted_mid and not gate_up else a  # else never read
        _moe_gemm_kernel[(self.tile_expert.numel() * triton.cdiv(n, tiles.block_n),)](
            a, a_desc, b, b_desc, c, self.weights, self.sorted_pairs, self.tile_expert,
            b_scales, n, k, self.pairs, self.num_experts, self.top_k, a.stride(0), b.stride(0),
            b.stride(1), c.stride(0), b_scales.stride(0), b_scales.stride(1), GATE_UP=gate_up,
            FP8_B=self.fp8, scale_rows=self.block[0], scale_cols=self.block[1], B_TMA=tma,
            SORTED_MID=sorted_mid, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            # float32 in full precision (tests, references), not tf32
            PRECISION="ieee" if self.dtype == torch.float32 else "tf32")


@triton.jit(do_not_specialize=["T"])
def _sum_slots_kernel(Parts, Out, T, H, K: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    # Out[t, h] = sum over s of Parts[t, s, h] (contiguous), in float32 in slot order
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (offs_t < T)[:, None] & (offs_h < H)[None, :]
    at = Parts + offs_t[:, None].to(tl.int64) * (K * H) + offs_h[None, :]
    total = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for s in tl.static_range(K):
        total += tl.load(at + s * H, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + offs_t[:, None].to(tl.int64) * H + offs_h[None, :],
             total.to(Out.dtype.element_ty), mask=ok)


def sum_slots(parts: torch.Tensor) -> torch.Tensor:
    """A token's k weighted expert outputs, parts [T, k, H] (contiguous), summed: [T, H] in
    their dtype, accumulated in float32 in slot order and rounded once. torch's reduction over
    the middle dimension took 109 us a layer at 8,192 tokens of Qwen3-30B-A3B on an H200 (0.3
    GB: about 63 us at the copy rate)."""
    t, k, h = parts.shape
    out = torch.empty(t, h, dtype=parts.dtype, device=parts.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_slots_kernel[(triton.cdiv(t, 4), triton.cdiv(h, block_h))](
        parts, out, t, h, K=k, BLOCK_T=4, BLOCK_H=block_h, num_warps=4)
    return out


ROUTE_TOKENS = 16  # tokens a program of the router kernel (fewer beyond 128 experts)
ROUTE_ONE_WARP_TOKENS = 16  # up to this many tokens (decode): a program of one warp a token


@triton.jit(do_not_specialize=["T"])
def _route_kernel(Logits, Weights, Ids, T, E, stride_l, TOP_K: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_T tokens: each one's softmax over its router logits in fp32, its top k (the
    lowest id among equal logits first), their probabilities renormalized to sum 1 when
    NORMALIZE. One pass of k argmaxes; the picks are kept in [BLOCK_T, BLOCK_K] and stored
    once."""
    pdl.start(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    offs = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    logits = tl.load(Logits + rows[:, None] * stride_l + offs[None, :],
                     mask=row_ok[:, None] & (offs < E)[None, :],
                     other=float("-inf")).to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    total = tl.sum(exps, axis=1)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    probs = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(logits, axis=1)
        hit = offs[None, :] == best[:, None]
        logits = tl.where(hit, float("-inf"), logits)
        here = slots[None, :] == slot
        ids = tl.where(here, best[:, None], ids)
        probs = tl.where(here, tl.sum(tl.where(hit, exps, 0.0), axis=1)[:, None], probs)
    probs = probs / total[:, None]
    if NORMALIZE:
        probs = probs / tl.sum(probs, axis=1)[:, None]
    at = rows[:, None] * TOP_K + slots[None, :]
    mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(Weights + at, probs.to(Weights.dtype.element_ty), mask=mask)
    tl.store(Ids + at, ids.to(tl.int64), mask=mask)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.route's result: the router's logits by cuBLAS (the same as moe.route's), then
    `pick`."""
    return pick(torch.nn.functional.linear(x, router), top_k, norm_topk_prob)


def pick(logits: torch.Tensor, top_k: int, norm_topk_prob: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.pick's result: the logits' softmax, top k and renormalization in one Triton kernel
    instead of four torch ones."""
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(e)
    if t <= ROUTE_ONE_WARP_TOKENS:  # a warp a token: its reductions stay within the warp
        block_t, warps = 1, 1
    else:  # [tokens, experts] within registers
        block_t, warps = max(1, min(ROUTE_TOKENS, 2048 // block_e)), 4
    pdl_args = pdl.launch_args(logits)
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, weights, ids, t, e, logits.stride(0), TOP_K=top_k, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), NORMALIZE=norm_topk_prob,
        **pdl_args, num_warps=warps)
    return weights, ids
