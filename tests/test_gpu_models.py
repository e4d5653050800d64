"""GPU: the long-context families in bf16 against transformers (YaRN Qwen3, Mistral,
Qwen3-MoE), the MoE layer's capturable paths against its reference loop, and MoE decode graphs
and offload against eager and resident."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GPU_SHAPE, make_hf_model, random_prompts
from helpers import engine_prefill_logits, make_llm

from nanoserve import LLM, SamplingParams
from nanoserve.models import moe
from nanoserve.models.loader import resolve_model_dir

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# YaRN's original context of 512 and factor 4: a 700-token prompt runs past the original
FAMILY_SHAPES = {
    "qwen3_yarn": dict(GPU_SHAPE, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 512}),
    "mistral": dict(GPU_SHAPE),  # head_dim 64: q and o projections of 512 != 256 features
    "qwen3_moe": dict(GPU_SHAPE, num_experts=16, num_experts_per_tok=4),
}


@pytest.fixture(scope="module", params=list(FAMILY_SHAPES))
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gpu-{request.param}")
    make_hf_model(request.param, path, **FAMILY_SHAPES[request.param])
    return request.param, path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-moe")
    make_hf_model("qwen3_moe", path, **FAMILY_SHAPES["qwen3_moe"])
    return path


def test_bf16_logits_as_close_to_fp32_as_transformers_bf16(family_model):
    """The bound of test_gpu_engine's: our bf16 error against an fp32 reference within 1.5x of
    transformers' own bf16 error against it, plus 1e-3. Argmax: equal to the fp32 one wherever
    that is confident, for the dense families; for MoE, agreeing at least as often as
    transformers' bf16 does (bf16 can flip a near-tie routing decision, in theirs and ours)."""
    from transformers import AutoModelForCausalLM

    arch, path = family_model
    ids = random_prompts(1, [700], vocab=2048)[0]
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():  # fresh loads: .to(bf16) on a loaded model also rounds RoPE buffers
        ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda")
        ref32.config._experts_implementation = "eager"  # the reference loop (MoE only)
        ref32 = ref32(x).logits[0].float().cpu()
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
        hf16 = hf16(x).logits[0].float().cpu()
    llm = LLM(str(path), progress=False, page_size=16, enforce_eager=True)
    ours = engine_prefill_logits(llm, ids).float()

    def rel(a):
        return ((a - ref32).norm() / ref32.norm()).item()

    assert rel(ours) < 1.5 * rel(hf16) + 1e-3, (arch, rel(ours), rel(hf16))
    top2 = ref32.topk(2, dim=-1).values
    confident = (top2[:, 0] - top2[:, 1]) > 0.1
    agree = (ours.argmax(-1) == ref32.argmax(-1))[confident].float().mean().item()
    if arch == "qwen3_moe":
        hf_agree = (hf16.argmax(-1) == ref32.argmax(-1))[confident].float().mean().item()
        assert agree >= hf_agree - 0.01, (agree, hf_agree)
    else:
        assert agree == 1.0, agree


# --- the MoE layer at Qwen3-30B-A3B's width ------------------------------------------------------
def _a3b_block(seed: int = 0) -> moe.SparseMoE:
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = moe.SparseMoE(2048, 128, 8, 768, norm_topk_prob=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block.requires_grad_(False)


def test_cuda_runs_the_fused_path():
    x = torch.zeros(4, 8, device="cuda", dtype=torch.bfloat16)
    assert moe.choose_path("auto", x) == "fused"


@pytest.mark.parametrize("tokens", [1, 3, 16, 64, 129, 512])
@pytest.mark.parametrize("case", ["empty experts", "one expert"])
@torch.inference_mode()
def test_fused_kernels_against_their_float64_twin(tokens, case, monkeypatch):
    """The Triton sort equals the torch one exactly (up to 128 tokens it runs as one program,
    beyond as three kernels over blocks of pairs); the fused kernels' bf16 result is within
    bf16 rounding of the float64 tile-by-tile twin on the same bf16 weights, at top-8 over 128
    experts, with experts no token routes to and with every token on one expert; with the
    weights' tiles loaded through TMA too."""
    from nanoserve.models import fused_moe, moe_tiles
    experts, top_k, hidden = 128, 8, 2048
    g = torch.Generator().manual_seed(tokens)
    if case == "one expert":
        rest = [3 + torch.randperm(experts - 3, generator=g)[:top_k - 1] for _ in range(tokens)]
        ids = torch.stack([torch.cat([torch.tensor([2]), r]) for r in rest])
    else:
        ids = torch.stack([2 + torch.randperm(experts // 2, generator=g)[:top_k]
                           for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    weights = (weights / weights.sum(-1, keepdim=True)).bfloat16().cuda()
    ids = ids.cuda()
    for block_m in (16, 64):
        got = fused_moe.sort_pairs(ids, experts, block_m)
        ref = moe_tiles.sort_pairs_reference(ids, experts, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), block_m
    block = _a3b_block().to(torch.bfloat16)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    x = torch.randn(tokens, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(2)
                    ).bfloat16()
    twin = moe_tiles.experts_tiled_reference(x.double(), weights.double(), ids, gate_up.double(),
                                             down.double(), 16)
    for tiles in {moe_tiles.default_tiles(tokens * top_k), moe_tiles.MoETiles(16, 32, 128, 4, 4),
                  moe_tiles.MoETiles(64, 128, 64, 8, 3),  # and the weights through TMA:
                  moe_tiles.MoETiles(128, 128, 64, 8, 4, True),
                  moe_tiles.MoETiles(16, 64, 128, 4, 3, True)}:
        got = fused_moe.experts_fused(x, weights, ids, gate_up, down, tiles)
        err = ((got.double() - twin).norm() / twin.norm()).item()
        assert err < 8e-3, (tiles, err)
        if tiles.tma:  # the intermediate in sorted order, down's rows through TMA: the same
            # products in the same order
            launched = []  # each GEMM's sorted_mid
            run = fused_moe._GemmLaunch.run
            monkeypatch.setattr(fused_moe._GemmLaunch, "run",
                                lambda self, *a, seen=launched, real=run:
                                seen.append(a[-2]) or real(self, *a))
            sorted_mid = fused_moe.experts_fused(x, weights, ids, gate_up, down,
                                                 tiles._replace(sorted_mid=True))
            monkeypatch.setattr(fused_moe._GemmLaunch, "run", run)
            assert launched == [True, True] and torch.equal(sorted_mid, got), tiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 8, 2048), (5, 2, 320), (8193, 8, 2048),
                                                   (3, 1, 96), (70, 16, 64)])
@torch.inference_mode()
def test_moe_sum_over_slots_rounds_the_float32_sum_once(dtype, tokens, top_k, hidden):
    """fused_moe.sum_slots (a token's k expert outputs summed) against the float64 sum: within
    the result's rounding (half a unit in the last place of its dtype) plus float32's
    accumulation of k terms; every row and column written (a partial last tile of tokens and
    of columns)."""
    from nanoserve.models import fused_moe
    g = torch.Generator("cuda").manual_seed(tokens)
    parts = torch.randn(tokens, top_k, hidden, device="cuda", generator=g).to(dtype)
    got = fused_moe.sum_slots(parts)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    exact = parts.double().sum(dim=1)
    half_ulp = torch.finfo(dtype).eps / 2
    bound = half_ulp * exact.abs() + 2 * top_k * 2.0**-24 * parts.double().abs().sum(dim=1)
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k, experts, hidden, inter", [(8, 128, 2048, 768), (4, 16, 256, 128),
                                                           (2, 8, 128, 64), (1, 4, 64, 192),
                                                           (16, 32, 64, 64), (2, 8, 320, 320)])
@torch.inference_mode()
def test_one_tokens_cuda_experts_against_the_triton_path_and_in_graphs(dtype, top_k, experts,
                                                                       hidden, inter,
                                                                       monkeypatch, request):
    """models/cuda_moe.py (batch 1: two CUDA kernels, no sort, no sum kernel) on the same
    weights and routing as the Triton fused path (top k 1 to 16: down's warps idle or taking up
    to 4 expert slots each; rows of 320 and 192: a step's second chunk cut short or missing;
    rows of 64: one lane in four loading): within 2^-7 of the largest output of it
    (a bf16 step or two: the dots summed in another order, then the same roundings), within
    8e-3 (relative norm) of the float64 tile-by-tile twin; experts_fused takes it at one token
    without tiles; a CUDA graph of it replayed with new inputs and new routing gives eager's
    result."""
    from nanoserve.extensions import ONE_ROW_SWITCH
    from nanoserve.models import cuda_moe, fused_moe, moe_tiles
    monkeypatch.setenv(ONE_ROW_SWITCH, "1")  # the default, whatever the caller's environment
    cuda_moe._extension.cache_clear()
    request.addfinalizer(cuda_moe._extension.cache_clear)  # later tests: the default again
    gen = torch.Generator("cuda").manual_seed(top_k)

    def inputs():
        x = torch.randn(1, hidden, device="cuda", generator=gen).to(dtype)
        ids = torch.randperm(experts, device="cuda", generator=gen)[:top_k].view(1, top_k)
        weights = torch.rand(1, top_k, device="cuda", generator=gen).softmax(-1).to(dtype)
        return x, weights, ids

    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.05
               ).to(dtype)
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.05).to(dtype)
    x, weights, ids = inputs()
    assert cuda_moe.supports(x, weights, ids, gate_up, down)
    got = cuda_moe.experts(x, weights, ids, gate_up, down)
    assert torch.equal(fused_moe.experts_fused(x, weights, ids, gate_up, down), got)
    triton = fused_moe.experts_fused(x, weights, ids, gate_up, down,
                                     moe_tiles.default_tiles(top_k)).float()
    assert (got.float() - triton).abs().max() <= 2**-7 * triton.abs().max()
    twin = moe_tiles.experts_tiled_reference(x.double(), weights.double(), ids,
                                             gate_up.double(), down.double(), 16)
    assert ((got.double() - twin).norm() / twin.norm()).item() < 8e-3
    static = [t.clone() for t in (x, weights, ids)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_moe.experts(*static, gate_up, down)
    for _ in range(3):
        for t, new in zip(static, inputs(), strict=True):
            t.copy_(new)
        graph.replay()
        assert torch.equal(out, cuda_moe.experts(*static, gate_up, down))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k, experts, hidden, inter, block", [
    (8, 128, 2048, 768, (128, 128)), (4, 16, 256, 128, (128, 128)), (2, 8, 320, 320, (64, 32)),
    (1, 4, 64, 192, (16, 16)), (16, 32, 576, 64, (128, 128))])
@torch.inference_mode()
def test_one_tokens_fp8_cuda_experts_against_the_triton_path_and_in_graphs(
        dtype, top_k, experts, hidden, inter, block, monkeypatch, request):
    """models/cuda_moe.py on e4m3 experts with block scales (FP8 block-wise checkpoints: 128 x
    128 as Qwen3-30B-A3B-FP8's; 64 x 32 and 16 x 16 blocks, so a lane's 16 inputs meet a new
    scale each chunk; 576 inputs in 128-column blocks: the last block half full), against the
    Triton fused path on the same weights and routing: within 2^-7 of the largest output of it;
    within 8e-3 (relative norm) of the float64 tile-by-tile twin on the dequantized stacks;
    experts_fused takes it at one token without tiles; a CUDA graph of it replayed with new
    inputs and routing gives eager's result."""
    from nanoserve.extensions import ONE_ROW_SWITCH
    from nanoserve.models import cuda_moe, fused_moe, moe_tiles
    monkeypatch.setenv(ONE_ROW_SWITCH, "1")
    cuda_moe._extension.cache_clear()
    request.addfinalizer(cuda_moe._extension.cache_clear)
    gen = torch.Generator("cuda").manual_seed(7 * top_k + hidden)

    def inputs():
        x = torch.randn(1, hidden, device="cuda", generator=gen).to(dtype)
        ids = torch.randperm(experts, device="cuda", generator=gen)[:top_k].view(1, top_k)
        weights = torch.rand(1, top_k, device="cuda", generator=gen).softmax(-1).to(dtype)
        return x, weights, ids

    def fp8_stack(rows, cols):
        w = (torch.randn(experts, rows, cols, device="cuda", generator=gen) * 64).clamp(-448, 448)
        grid = (experts, -(-rows // block[0]), -(-cols // block[1]))
        s = torch.rand(grid, device="cuda", generator=gen) * 1e-3 + 2e-4
        dense = w.to(torch.float8_e4m3fn).double() * s.double().repeat_interleave(
            block[0], 1).repeat_interleave(block[1], 2)[:, :rows, :cols]
        return w.to(torch.float8_e4m3fn), s, dense

    gate_up, gate_up_s, gate_up_dense = fp8_stack(2 * inter, hidden)
    down, down_s, down_dense = fp8_stack(hidden, inter)
    scales = (gate_up_s, down_s)
    x, weights, ids = inputs()
    assert cuda_moe.supports(x, weights, ids, gate_up, down, scales, block)
    assert not cuda_moe.supports(x, weights, ids, gate_up, down)  # e4m3 without its scales
    got = cuda_moe.experts(x, weights, ids, gate_up, down, scales, block)
    assert torch.equal(fused_moe.experts_fused(x, weights, ids, gate_up, down, scales=scales,
                                               block=block), got)
    triton = fused_moe.experts_fused(x, weights, ids, gate_up, down, moe_tiles.default_tiles(
        top_k), scales=scales, block=block).float()
    assert (got.float() - triton).abs().max() <= 2**-7 * triton.abs().max()
    twin = moe_tiles.experts_tiled_reference(x.double(), weights.double(), ids, gate_up_dense,
                                             down_dense, 16)
    assert ((got.double() - twin).norm() / twin.norm()).item() < 8e-3
    static = [t.clone() for t in (x, weights, ids)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_moe.experts(*static, gate_up, down, scales, block)
    for _ in range(3):
        for t, new in zip(static, inputs(), strict=True):
            t.copy_(new)
        graph.replay()
        assert torch.equal(out, cuda_moe.experts(*static, gate_up, down, scales, block))


@pytest.mark.parametrize("tokens", [129, 1000, 8192, 20000])
@pytest.mark.parametrize("one_expert", [False, True])
def test_the_blocked_sort_equals_torchs_at_prefill_sizes(tokens, one_expert):
    """Beyond one program's 1,024 pairs the sort runs over blocks of pairs (three kernels): its
    layout equals the torch reference's exactly, pairs in order within each expert, at every
    tile height, with every token on one expert too (one expert's pairs span every block)."""
    from nanoserve.models import fused_moe, moe_tiles
    g = torch.Generator(device="cuda").manual_seed(tokens)
    ids = torch.rand(tokens, 128, device="cuda", generator=g).topk(8, dim=-1).indices
    if one_expert:
        ids[:, 0] = 5
        ids[:, 1:] = torch.where(ids[:, 1:] == 5, 127 - (ids[:, :1] % 7), ids[:, 1:])
    for block_m in (16, 64, 128):
        got = fused_moe.sort_pairs(ids, 128, block_m)
        ref = moe_tiles.sort_pairs_reference(ids, 128, block_m)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), block_m


@pytest.mark.parametrize("inter", [192, 96])
@torch.inference_mode()
def test_tma_tiles_past_the_edges_of_the_experts(inter):
    """Weights through TMA where the tiles overrun the experts: 192 or 96 intermediate rows in
    128-column tiles (gate's last tile reads into up's rows, up's past the expert: zeros),
    200 inputs in 64-wide steps (a zero-filled tail), 60 experts; and the sorted
    intermediate's rows through TMA, 96 wide in 64-wide steps. Within bf16 rounding of the
    float64 twin, as the pointer loads are."""
    from nanoserve.models import fused_moe, moe_tiles
    experts, hidden, tokens = 60, 200, 300
    g = torch.Generator("cuda").manual_seed(inter)
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.05
               ).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.05).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    router = torch.randn(experts, hidden, device="cuda", generator=g).bfloat16()
    weights, ids = moe.route(x, router, 8, True)
    twin = moe_tiles.experts_tiled_reference(x.double(), weights.double(), ids,
                                             gate_up.double(), down.double(), 128)
    for tma, sorted_mid in ((False, False), (True, False), (True, True)):
        tiles = moe_tiles.MoETiles(128, 128, 64, 8, 3, tma, sorted_mid)
        got = fused_moe.experts_fused(x, weights, ids, gate_up, down, tiles).double()
        assert ((got - twin).norm() / twin.norm()).item() < 8e-3, tiles


@pytest.mark.parametrize("block_m", [16, 128])
def test_the_blocked_sort_with_most_experts_empty(block_m):
    """60 experts, the 3,000 tokens' 24,000 pairs on 9 of them: the blocked sort's layout
    equals torch's, the empty experts taking no rows and no tiles."""
    from nanoserve.models import fused_moe, moe_tiles
    g = torch.Generator(device="cuda").manual_seed(block_m)
    ids = torch.rand(3000, 9, device="cuda", generator=g).argsort(-1)[:, :8] * 7 % 60
    got = fused_moe.sort_pairs(ids, 60, block_m)
    ref = moe_tiles.sort_pairs_reference(ids, 60, block_m)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert ref[1].unique().numel() == 10  # nine experts' tiles and the unused ones' (60)


@pytest.mark.parametrize("tokens", [1, 7, 16, 17, 64, 4096])
@pytest.mark.parametrize("norm", [True, False])
@torch.inference_mode()
def test_the_fused_router_picks_torchs_experts_with_its_weights(tokens, norm):
    """fused_moe.route (one kernel for the softmax, top-k and renormalization: a warp a token up
    to 16 tokens, 16 tokens a program above) against moe.route on float32 logits, where ties
    do not occur: the same experts in the same order, weights within 1e-6. Equal logits: the
    lowest id first, then the rest as torch picks them."""
    from nanoserve.models import fused_moe
    g = torch.Generator("cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=g)
    router = torch.randn(128, 2048, device="cuda", generator=g) * 0.02
    w_ref, ids_ref = moe.route(x, router, 8, norm)
    w, ids = fused_moe.route(x, router, 8, norm)
    assert torch.equal(ids, ids_ref)
    assert (w - w_ref).abs().max().item() < 1e-6
    logits = torch.nn.functional.linear(x, router)
    logits[:, 90] = logits[:, 7] = logits.max(1).values + 1  # a tie at the top of every row
    _, ids = fused_moe.pick(logits, 8, norm)
    _, ids_ref = moe.pick(logits, 8, norm)
    assert (ids[:, :2] == torch.tensor([7, 90], device="cuda")).all()
    assert torch.equal(ids[:, 2:], ids_ref[:, 2:])


@pytest.mark.parametrize("tokens", [1, 8, 32, 300])
@pytest.mark.parametrize("path", ["fused", "grouped", "gather"])
@torch.inference_mode()
def test_capturable_moe_paths_in_bf16_as_close_to_fp32_as_the_loop(tokens, path):
    """Bound: a path's bf16 error against the fp32 loop within 1.5x of the bf16 loop's own,
    plus 1e-3 relative. The router is shared, so the three paths route alike; the paths differ
    in GEMM rounding and in how the k outputs are summed (loop: bf16 adds, one per expert;
    grouped and gather: one fp32-accumulated batched GEMM)."""
    if path == "grouped" and not moe.fast_grouped_mm(torch.device("cuda"), torch.bfloat16):
        pytest.skip("no fast grouped GEMM on this GPU")
    if path == "gather" and tokens > moe.GATHER_MAX_TOKENS:
        pytest.skip("gather copies k experts a token: decode batches only")
    block = _a3b_block()
    x = torch.randn(tokens, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    block.backend = "loop"
    ref = block(x).float()
    block.to(torch.bfloat16)
    loop = block(x.bfloat16()).float()
    block.backend = path
    got = block(x.bfloat16()).float()

    def rel(a):
        return ((a - ref).norm() / ref.norm()).item()

    assert rel(got) < 1.5 * rel(loop) + 1e-3, (rel(got), rel(loop))


@pytest.mark.parametrize("path", ["fused", "grouped", "gather"])
@torch.inference_mode()
def test_moe_layer_replays_in_a_cuda_graph(path):
    """No host sync and static shapes: the layer captures, and replaying it on new inputs gives
    what eager gives on them."""
    if path == "grouped" and not moe.fast_grouped_mm(torch.device("cuda"), torch.bfloat16):
        pytest.skip("no fast grouped GEMM on this GPU")
    block = _a3b_block().to(torch.bfloat16)
    block.backend = path
    x = torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16)
    block(x)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, block(x)), seed


# --- the engine ---------------------------------------------------------------------------------
def test_moe_graph_replay_equals_eager_for_every_captured_batch_size(moe_dir):
    graphs = LLM(str(moe_dir), progress=False, page_size=16, max_graph_batch_size=16)
    eager = LLM(str(moe_dir), progress=False, page_size=16, enforce_eager=True)
    assert graphs.engine.runner.graphs.sizes == [1, 2, 4, 8, 16]
    for n in (1, 3, 8, 13, 16):
        prompts = random_prompts(n, [5, 200, 33, 1000, 64], vocab=2048, seed=n)
        a = [o.token_ids for o in graphs.generate(prompts, GREEDY)]
        b = [o.token_ids for o in eager.generate(prompts, GREEDY)]
        assert a == b, f"batch {n}"


def test_fused_moe_greedy_tokens_equal_the_loops(moe_dir):
    """In float32 (the kernels' dots in full precision, not tf32) the fused path, in decode
    graphs, gives the reference loop's greedy tokens (eager: the loop cannot be captured)."""
    prompts = random_prompts(6, [5, 200, 33, 700, 64, 9], vocab=2048, seed=6)
    kw = dict(device="cuda", page_size=16, dtype="float32", max_model_len=2048)
    fused = make_llm(moe_dir, moe_backend="fused", **kw)
    loop = make_llm(moe_dir, moe_backend="loop", enforce_eager=True, **kw)
    assert fused.engine.runner.graphs is not None
    assert [o.token_ids for o in fused.generate(prompts, GREEDY)] == \
        [o.token_ids for o in loop.generate(prompts, GREEDY)]


@pytest.mark.parametrize("eager", [True, False])
def test_moe_offload_tokens_equal_resident(moe_dir, eager):
    prompts = random_prompts(4, [1500, 37, 800, 260], vocab=2048, seed=4)
    kw = dict(device="cuda", page_size=16, max_num_seqs=8, max_model_len=4096,
              max_num_batched_tokens=512, enforce_eager=eager)
    ref = [o.token_ids for o in make_llm(moe_dir, **kw).generate(prompts, GREEDY)]
    off = make_llm(moe_dir, enable_offload=True, resident_layers=1, host_kv_budget_gib=1, **kw)
    assert off.engine.kv.plan.streamed_layers == 3
    assert [o.token_ids for o in off.generate(prompts, GREEDY)] == ref


def test_qwen3_30b_a3b_widths_decode_in_graphs_at_batch_1_and_32(tmp_path):
    """The real layer widths (4 of its 48 layers, dummy weights): graphs equal eager at the
    bench's two batch sizes."""
    raw = json.loads((resolve_model_dir("Qwen3-30B-A3B", True) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 4}))
    kw = dict(progress=False, dummy_weights=True, max_model_len=1024, max_num_seqs=32)
    graphs, eager = LLM(str(tmp_path), **kw), LLM(str(tmp_path), enforce_eager=True, **kw)
    for n in (1, 32):
        prompts = random_prompts(n, [300, 17, 512], vocab=151936, seed=n)
        a = [o.token_ids for o in graphs.generate(prompts, GREEDY)]
        assert a == [o.token_ids for o in eager.generate(prompts, GREEDY)], f"batch {n}"
        assert all(len(t) == 24 for t in a)
