"""GPU: the Triton paged decode kernel against a float64 reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def reference_decode(q, k_cache, v_cache, page_tables, lens, scale):
    out = []
    for b, n in enumerate(lens.tolist()):
        ps = k_cache.shape[1]
        pages = page_tables[b, :(n + ps - 1) // ps].long()
        k = k_cache[pages].flatten(0, 1)[:n].double()  # [n, kvh, d]
        v = v_cache[pages].flatten(0, 1)[:n].double()
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def random_paged(batch, lens, heads, kv_heads, d, page_size, dtype, gen):
    dev = "cuda"
    pages_per = [(n + page_size - 1) // page_size for n in lens]
    total = sum(pages_per) + 1
    k_cache = torch.randn(total, page_size, kv_heads, d, device=dev, dtype=dtype, generator=gen)
    v_cache = torch.randn(total, page_size, kv_heads, d, device=dev, dtype=dtype, generator=gen)
    perm = torch.randperm(total - 1, device=dev, generator=gen) + 1  # scattered pages
    width = max(pages_per)
    table = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    start = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[start:start + p].int()
        start += p
        for cache in (k_cache, v_cache):  # NaNs past the context in its last page: masked
            cache[table[b, p - 1], (lens[b] - 1) % page_size + 1:] = float("nan")
    q = torch.randn(batch, heads, d, device=dev, dtype=dtype, generator=gen)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32, device=dev)


@pytest.mark.parametrize("lens", [[1], [7], [300], [4096], [32768], [131072], [1, 5000, 77],
                                  [2048] * 16, [40000, 3, 900, 12000]])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (28, 4), (8, 8)])
@pytest.mark.parametrize("page_size, tma", [(16, False), (256, False), (256, True)],
                         ids=["page16", "page256", "page256-tma"])
@pytest.mark.parametrize("transposed", [False, True])
def test_triton_decode_matches_float64_reference(lens, heads, kv_heads, page_size, tma,
                                                 transposed):
    from nanoserve.attention.triton_decode import (
        TILES,
        num_splits_for,
        paged_decode_attention,
    )

    if max(lens) >= 131072 and (page_size, heads) != (256, 32):
        pytest.skip("the 128K case runs once, for the main shape, to bound the test's time")
    gen = torch.Generator(device="cuda").manual_seed(len(lens) * 1000 + heads + page_size)
    d = 128
    q, kc, vc, table, lens_t = random_paged(len(lens), lens, heads, kv_heads, d, page_size,
                                            torch.bfloat16, gen)
    scale = d**-0.5
    splits = num_splits_for(len(lens), kv_heads, 131072, 132)
    out = paged_decode_attention(q, kc, vc, table, lens_t, scale, splits,
                                 tiles=TILES["default"]._replace(tma=tma,
                                                                 transposed=transposed))
    ref = reference_decode(q, kc, vc, table, lens_t, scale)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all()
    assert rel < 1e-2, f"relative error {rel}"


@pytest.mark.parametrize("lens", [[7], [300, 4096], [2048] * 16])
@pytest.mark.parametrize("tiles", [("default", False), ("default", True), ("batched", True)],
                         ids=["default", "transposed", "batched-tma-transposed"])
def test_triton_decode_with_one_split_writes_the_output_itself(lens, tiles):
    """One split: no merge kernel, the split kernel's normalized output stored directly, within
    the split path's bound of float64; "batched" is large batches' bf16 path (one split, TMA
    tiles, transposed dots)."""
    from nanoserve.attention.triton_decode import TILES, paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(sum(lens))
    q, kc, vc, table, lens_t = random_paged(len(lens), lens, 32, 8, 128, 256, torch.bfloat16,
                                            gen)
    name, transposed = tiles
    out = paged_decode_attention(q, kc, vc, table, lens_t, 128**-0.5, 1,
                                 tiles=TILES[name]._replace(transposed=transposed))
    ref = reference_decode(q, kc, vc, table, lens_t, 128**-0.5)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("heads, kv_heads", [(32, 4), (64, 4)], ids=["group8", "group16"])
@pytest.mark.parametrize("tiles", [("default", False), ("default", True), ("batched", True)],
                         ids=["default", "transposed", "batched-tma-transposed"])
def test_triton_decode_takes_groups_of_8_and_16(heads, kv_heads, tiles):
    """A GQA group of 8 (Qwen3-30B-A3B) fills the transposed form's 8-wide MMA side exactly;
    16 takes two of it: both within the bound of the other decode tests, NaNs past each context
    masked."""
    from nanoserve.attention.triton_decode import TILES, paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(heads)
    lens = [300, 4096, 9]
    q, kc, vc, table, lens_t = random_paged(3, lens, heads, kv_heads, 128, 256, torch.bfloat16,
                                            gen)
    name, transposed = tiles
    out = paged_decode_attention(q, kc, vc, table, lens_t, 128**-0.5, 4,
                                 tiles=TILES[name]._replace(transposed=transposed))
    ref = reference_decode(q, kc, vc, table, lens_t, 128**-0.5)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("transposed", [False, True])
def test_triton_decode_fp32_is_tight(transposed):
    from nanoserve.attention.triton_decode import TILES, paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, kc, vc, table, lens_t = random_paged(3, [100, 2000, 9], 16, 4, 64, 16, torch.float32, gen)
    out = paged_decode_attention(q, kc, vc, table, lens_t, 0.125, 8,
                                 tiles=TILES["default"]._replace(transposed=transposed))
    ref = reference_decode(q, kc, vc, table, lens_t, 0.125)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_every_split_count_and_page_table_width_run_on_one_compiled_kernel():
    """The split count (a function of the batch size) and the page table's width are not
    compile-time constants: the eager decode rows of mixed steps come in every number and
    width, and each new one compiled the split and merge kernels inside a request (about 4 s
    in a 32 x 4,096 prefill). Counts 1-40 and tables 1-17 pages wider each stay within the
    bound of float64, and after the first call nothing compiles."""
    from nanoserve.attention.triton_decode import (
        TILES,
        _decode_split_kernel,
        _merge_splits_kernel,
        paged_decode_attention,
    )

    def compiled() -> tuple[int, int]:
        return tuple(sum(len(caches[0]) for caches in kernel.device_caches.values())
                     for kernel in (_decode_split_kernel, _merge_splits_kernel))

    gen = torch.Generator(device="cuda").manual_seed(7)
    lens = [5000, 77, 1300]
    q, kc, vc, table, lens_t = random_paged(3, lens, 32, 4, 128, 256, torch.bfloat16, gen)
    ref = reference_decode(q, kc, vc, table, lens_t, 128**-0.5)
    first = None
    for splits in range(2, 41):
        wider = torch.nn.functional.pad(table, (0, splits % 17))  # unused columns
        out = paged_decode_attention(q, kc, vc, wider, lens_t, 128**-0.5, splits,
                                     tiles=TILES["default"])
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, splits
        first = first or compiled()
        assert compiled() == first, f"{splits} splits, {wider.shape[1]} pages compiled again"
