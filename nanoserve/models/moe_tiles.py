"""The fused MoE path's layout and tiles, without Triton (fused_moe.py has the kernels): how
the (token, slot) pairs are sorted by expert into whole tiles, the tiles a batch runs with (a
tuned config file per GPU, else defaults), and a torch twin of the kernels' work over that
layout, which the CPU tests check in float64 against the loop and the GPU tests check the
kernels against."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanoserve.models.config import ModelConfig

CONFIG_DIR = Path(__file__).with_name("moe_configs")
log = logging.getLogger("nanoserve")


class MoETiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # the experts' weight tiles through TMA descriptors (bf16 / fp16)
    # with tma: the intermediate in sorted order, down's row tiles through TMA too
    sorted_mid: bool = False


def default_tiles(pairs: int) -> MoETiles:
    """Tiles for `pairs` (token, slot) pairs without a tuned config: decode's few rows per
    expert in tiles of 16 with narrow columns (more programs to fill the SMs); prefill's in
    large square tiles, the weights through TMA (H200, 8,192 tokens: the experts' kernels
    1,539 -> 1,391 us, 56% of the matmul rate; tools/probes/moe_prefill.py) and the
    intermediate in sorted order (1,238 -> 1,215 us, session 36)."""
    if pairs <= 64:
        return MoETiles(16, 32, 128, 4, 4)
    if pairs <= 512:
        return MoETiles(16, 64, 128, 4, 4)
    if pairs <= 4096:
        return MoETiles(64, 64, 64, 4, 4)
    return MoETiles(128, 128, 64, 8, 3, tma=True, sorted_mid=True)


def config_key(num_experts: int, hidden: int, inter: int) -> str:
    return f"E={num_experts},H={hidden},I={inter}"


def model_shape(cfg: ModelConfig, tp: int = 1) -> dict:
    """What config_key names for `cfg` at tensor parallel size `tp` (each expert's intermediate
    rows split over the ranks), with the top k: tools/tune_moe.py's shape. ValueError for a
    dense model or a size that does not divide it."""
    if not cfg.moe_layers:
        raise ValueError(f"{cfg.architecture} has no mixture-of-experts layers")
    cfg.check_tensor_parallel(tp)
    return dict(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, hidden=cfg.hidden_size,
                inter=cfg.moe_intermediate_size // tp)


@functools.cache
def _device_name(index: int | None) -> str:  # asked every layer of every step: once
    return torch.cuda.get_device_name(index)


def config_file(device_name: str) -> str:
    """The config file's name for a GPU (moe_configs/<it>, tools/tune_moe.py --write)."""
    return device_name.replace(" ", "_") + ".json"


@functools.cache
def _tuned(device_name: str) -> dict:
    path = CONFIG_DIR / config_file(device_name)
    return json.loads(path.read_text()) if path.exists() else {}


def tiles_for(pairs: int, num_experts: int, hidden: int, inter: int,
              device: torch.device) -> MoETiles:
    """The tuned tiles of the smallest band holding `pairs` on this GPU, else the defaults
    (with a warning, once, where this GPU has none for the shape)."""
    name, key = _device_name(device.index), config_key(num_experts, hidden, inter)
    bands = _tuned(name).get(key) or {}
    if not bands:
        _warn_untuned(name, key)
    for limit in sorted(int(b) for b in bands):
        if pairs <= limit:
            return MoETiles(**bands[str(limit)])
    return default_tiles(pairs)


@functools.cache
def _warn_untuned(device_name: str, key: str) -> None:
    log.warning("fused MoE: no tuned tiles for %s (experts, hidden, intermediate per GPU) on "
                "%s; running default tiles, which may be slower. `python tools/tune_moe.py "
                "--model MODEL [--tp N] --write` tunes them into %s", key, device_name,
                CONFIG_DIR)


def padded_sizes(pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(rows, tiles) of the sorted layout at most: each expert with pairs pads its rows to a
    whole tile, and at most min(E, pairs) experts have pairs."""
    rows = pairs + min(num_experts, pairs) * (block_m - 1)
    rows = -(-rows // block_m) * block_m
    return rows, rows // block_m


def sort_pairs_reference(ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair of each sorted row, int32 [rows]: `pairs` for a padding row; expert of each tile,
    int32 [tiles]: num_experts past the used tiles). Pairs are ids.flatten()'s indices; each
    expert's rows are its pairs in order, from a tile boundary. Torch ops, no host sync."""
    flat = ids.flatten().long()
    pairs = flat.numel()
    rows, tiles = padded_sizes(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((rows,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(ends - padded)[expert] + rank] = order.to(torch.int32)
    tile_start = torch.arange(tiles, device=ids.device) * block_m
    tile_expert = torch.searchsorted(ends, tile_start, right=True).to(torch.int32)
    return sorted_pairs, tile_expert




def experts_tiled_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, block_m: int
                            ) -> torch.Tensor:
    """fused_moe.experts_fused's result, computed tile by tile over sort_pairs_reference's
    layout as its kernels do (a host loop: a reference, not a path)."""
    t, k = ids.shape
    inter = gate_up.shape[1] // 2
    sorted_pairs, tile_expert = sort_pairs_reference(ids, gate_up.shape[0], block_m)
    pairs = t * k
    out = torch.zeros(pairs, x.shape[1], dtype=torch.float64 if x.dtype == torch.float64
                      else torch.float32, device=x.device)
    for tile, expert in enumerate(tile_expert.tolist()):
        if expert >= gate_up.shape[0]:
            continue
        rows = sorted_pairs[tile * block_m:(tile + 1) * block_m].long()
        rows = rows[rows < pairs]
        h = F.linear(x[rows // k], gate_up[expert])
        mid = F.silu(h[:, :inter]) * h[:, inter:]
        out[rows] = F.linear(mid, down[expert]).to(out.dtype) * \
            weights.reshape(-1)[rows, None].to(out.dtype)
    return out.view(t, k, -1).sum(dim=1).to(x.dtype)
