"""GPU: programmatic dependent launch (nanoserve/pdl.py) keeps the order of dependent kernels.

A chain of decode layers made of the hand-written kernels and an inductor one, each reading the
previous one's output and the KV slot the previous layer overwrote, replayed from a CUDA graph
with PDL, equals the same chain launched eagerly without PDL, bit for bit. A kernel that
touched memory before its wait would read a stale input or a slot still being written."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper (or later) GPU: PDL")


def decode_chain(x, weights, cache, layers):
    """`layers` decode layers of one token at position 300 of a 512-token page, Qwen3-8B's
    shapes: qkv (skinny matmul), rope + store, paged attention, o (skinny), add + norm."""
    from nanoserve.attention.triton_decode import paged_decode_attention
    from nanoserve.attention.triton_rope_store import rope_and_store
    from nanoserve.models.layers import add_rms_norm
    from nanoserve.models.triton_linear import skinny_linear

    w_qkv, w_o, norm_w, cos_sin = weights
    k_cache, v_cache, table, lens, positions, slots = cache
    h = x
    for _ in range(layers):
        qkv = skinny_linear(h, w_qkv)
        q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
        q, _ = rope_and_store(q.view(1, 32, 128), k.view(1, 8, 128), v.view(1, 8, 128), cos_sin,
                              positions, None, k_cache, v_cache, slots)
        o = paged_decode_attention(q, k_cache, v_cache, table, lens, 128**-0.5, 16)
        x, h = add_rms_norm(x, skinny_linear(o.view(1, 4096), w_o), norm_w, 1e-6)
    return h


@needs_hopper
def test_a_pdl_chain_in_a_graph_equals_the_eager_chain_without_pdl():
    from nanoserve import pdl

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    weights = (torch.randn(6144, 4096, generator=g, **bf16) * 4096**-0.5,
               torch.randn(4096, 4096, generator=g, **bf16) * 4096**-0.5,
               torch.rand(4096, generator=g, **bf16) + 0.5,
               torch.randn(512, 128, generator=g, device="cuda"))
    caches = [torch.randn(2, 512, 8, 128, generator=g, **bf16) for _ in range(2)]

    def cache():
        return (caches[0].clone(), caches[1].clone(),
                torch.tensor([[1]], dtype=torch.int32, device="cuda"),
                torch.tensor([301], dtype=torch.int32, device="cuda"),
                torch.tensor([300], device="cuda"), torch.tensor([812], device="cuda"))

    x = torch.randn(1, 4096, generator=g, **bf16)
    try:
        pdl.force(False)
        expected = decode_chain(x, weights, cache(), 12)
        pdl.force(True)
        replayed_cache = cache()
        decode_chain(x, weights, replayed_cache, 12)  # compiles; graphs capture no compile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_chain(x, weights, replayed_cache, 12)
        for _ in range(3):  # the slot each layer writes is read by its attention
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected)
    finally:
        pdl.force(None)
    assert expected.abs().max().item() > 0.1  # a real chain, not one that died out to zeros
