"""A linear layer whose weight is held quantized, in its checkpoint's own tensors
(quant/formats.py): the memory it takes, and the weight bytes a step reads, are the quantized
ones.

On a GPU its product runs quant/triton_gemm.py's kernels (FP8 on FP8 tensor cores, x quantized
per 128 inputs, by the norm ahead of the layer where that norm is handed the layer
(`norm_input`); the 4-bit formats dequantized inside the GEMM / GEMV; one row of AWQ or FP8
through quant/cuda_gemv.py's CUDA kernels where they build, unless NANOSERVE_ONE_ROW_CUDA=0);
elsewhere, and where those do not take the rows, it dequantizes the weight and multiplies: the
reference path, which the kernels are tested against.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.quant.config import QuantConfig
from nanoserve.quant.formats import dequantize, fill_dummy, gptq_as_awq, tensor_specs


class QuantizedRows(NamedTuple):
    """Rows x already in the form an FP8 layer's kernel takes them (QuantizedLinear.norm_input:
    the norm ahead of the layer quantized its output): e4m3 values [padded rows, K]
    (triton_gemm.quantized_rows), their float32 scales [padded rows, K / group] stored
    group-major (strides 1, padded rows), the real row count and x's dtype."""
    values: torch.Tensor
    scales: torch.Tensor
    rows: int
    dtype: torch.dtype


class QuantizedLinear(nn.Module):
    """y = x W^T (+ bias) for W [sum(shard_sizes), in_features], held quantized. A fused
    projection's shards (q, k, v; gate, up) sit side by side in each tensor (shard_view);
    tensors without an output dimension (a per-tensor scale, GPTQ's g_idx) hold one per
    shard."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool,
                 quant: QuantConfig, scale_dtype: torch.dtype, row_parallel: bool = False
                 ) -> None:
        super().__init__()
        self.in_features, self.shard_sizes, self.quant = in_features, shard_sizes, quant
        self.row_parallel = row_parallel  # under TP: its inputs split (o, down), else outputs
        self.out_features = sum(shard_sizes)
        self.specs = [tensor_specs(quant, n, in_features, scale_dtype) for n in shard_sizes]
        for name, spec in self.specs[0].items():
            if spec.out_dim is None:
                shape = (len(shard_sizes), *spec.shape)
            else:
                shape = list(spec.shape)
                shape[spec.out_dim] = sum(s[name].shape[spec.out_dim] for s in self.specs)
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=spec.dtype),
                                                       requires_grad=False))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        # act-order GPTQ run as AWQ: the order its kernels read the inputs in (_gptq_as_awq)
        self.register_buffer("input_order", None, persistent=False)

    def tp_dim(self, name: str) -> int | None:
        """The dimension of tensor `name` (counted from the end: a checkpoint's shard tensor and
        the parameter agree) that tensor parallelism splits; None: every rank holds all of it."""
        if name == "bias":  # one per output, as a dense layer's
            return None if self.row_parallel else -1
        spec = self.specs[0][name]
        dim = spec.in_dim if self.row_parallel else spec.out_dim
        return None if dim is None else dim - len(spec.shape)

    @torch.no_grad()
    def finish_loading(self, name: str) -> None:
        """After the checkpoint's tensors (or dummy ones) are in: GPTQ's g_idx numbered from
        this rank's first group (under tensor parallelism a row-parallel rank holds a run of
        groups, the checkpoint numbers them globally; at TP=1 this changes nothing). ValueError
        where the rank's inputs reach groups it does not hold: a g_idx out of order (act-order)
        though the config says desc_act false. Then GPTQ over whole groups becomes AWQ
        (formats.gptq_as_awq; act-order with its inputs sorted by group: _gptq_as_awq), whose
        kernels are faster (the one-row CUDA GEMV, the tensor-core GEMM at few rows)."""
        if self.quant.method != "gptq":
            return
        self.g_idx -= self.g_idx.min()
        if self.g_idx.max().item() >= self.scales.shape[0]:
            raise ValueError(f"{name}: its g_idx reaches groups outside this rank's inputs (an "
                             f"act-order checkpoint whose config says desc_act false?); run it at "
                             f"tensor parallel size 1")
        self._gptq_as_awq()

    def _gptq_as_awq(self) -> None:
        """The layer's GPTQ tensors repacked as AWQ's, and its format AWQ, where its inputs
        fall into whole groups, its shards share one g_idx and AWQ's layout holds its zero
        points; g_idx then goes (the memory plan, made from the checkpoint's tensors, counted
        its 4 bytes an input). Act-order (the groups not in input order): the inputs sorted by
        group, `input_order` holding the order, in which the kernels then read x (gathered
        inside the one-row CUDA GEMV, else one gather a product) for AWQ's kernels in place of
        the element-by-element act-order GEMM."""
        q, k = self.quant, self.in_features
        g_idx = self.g_idx[0]
        in_order = torch.arange(k, device=g_idx.device, dtype=g_idx.dtype) // q.group_size
        if k % q.group_size or not all(torch.equal(g, g_idx) for g in self.g_idx):
            return
        order = None if torch.equal(g_idx, in_order) else torch.argsort(g_idx, stable=True)
        if order is not None and not torch.equal(g_idx[order], in_order):
            return  # groups of other sizes than group_size
        awq = gptq_as_awq(q, self.qweight, self.qzeros, order)
        if awq is None:
            return
        self.qweight = nn.Parameter(awq[0], requires_grad=False)
        self.qzeros = nn.Parameter(awq[1], requires_grad=False)
        self.input_order = None if order is None else order.to(torch.int32)
        del self.g_idx
        self.quant = QuantConfig("awq", group_size=q.group_size, skip=q.skip)
        self.specs = [tensor_specs(self.quant, n, k, self.scales.dtype)
                      for n in self.shard_sizes]

    def shard_view(self, name: str, shard: int) -> torch.Tensor:
        """Shard `shard`'s part of tensor `name` (what the checkpoint's q_proj.`name` fills)."""
        if name == "bias":
            start = sum(self.shard_sizes[:shard])
            return self.bias[start:start + self.shard_sizes[shard]]
        spec = self.specs[shard][name]
        tensor = getattr(self, name)
        if spec.out_dim is None:
            return tensor[shard]
        start = sum(s[name].shape[spec.out_dim] for s in self.specs[:shard])
        return tensor.narrow(spec.out_dim, start, spec.shape[spec.out_dim])

    def shard_tensors(self, shard: int) -> dict[str, torch.Tensor]:
        return {name: self.shard_view(name, shard) for name in self.specs[shard]}

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out_features, in_features] in `dtype` (inputs in the checkpoint's order)."""
        w = torch.cat([dequantize(self.quant, self.shard_tensors(i), n, self.in_features, dtype)
                       for i, n in enumerate(self.shard_sizes)])
        if self.input_order is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.input_order.long(), w)

    @torch.no_grad()
    def fill_dummy(self, generator: torch.Generator) -> None:
        for shard in range(len(self.shard_sizes)):
            fill_dummy(self.quant, self.shard_tensors(shard), generator)
        if hasattr(self, "g_idx"):  # one order for all shards: GPTQ orders a layer's inputs
            self.g_idx[1:] = self.g_idx[0]  # by their Hessian, which q, k and v (gate and up) share
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self._quantized_rows_forward(x)
        if x.is_cuda:
            y = self.kernel_forward(x.reshape(-1, x.shape[-1]))
            if y is not None:
                return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The product through a kernel that dequantizes inside it, for rows x [M,
        in_features]: one row (AWQ, FP8) through the CUDA GEMVs (quant/cuda_gemv.py) where they
        build, take the shape and are not switched off, the rest through Triton's
        (quant/triton_gemm.py); None where no kernel takes them (quant/triton_gemm.supports) or
        this layer (a fused GPTQ layer whose shards' g_idx differ)."""
        triton_gemm = _triton_gemm()
        if triton_gemm is None:
            return None
        args = self._kernel_args()
        x = x.contiguous()
        if args is not None and x.shape[0] == 1:  # the CUDA GEMV gathers x in input_order
            from nanoserve.quant import cuda_gemv
            y = cuda_gemv.one_row(x, args, x_order=self.input_order)
            if y is not None:
                return y if self.bias is None else y + self.bias
        if self.input_order is not None:
            x = x.index_select(1, self.input_order)
        if args is None or not triton_gemm.supports(
                x, args["fmt"], self.in_features, args.get("scale_cols", 1 << 30),
                args.get("group", 128)):
            return None
        y = triton_gemm.quant_gemm(x, n=self.out_features, **args)
        return y if self.bias is None else y + self.bias

    def silu_kernel_forward(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu(gate) * up) for rows [gate | up] where an FP8 product quantizes its x (from
        triton_gemm.WIDE_ROWS rows): silu(gate) * up computed in that quantization pass, so no
        SiLU kernel runs ahead of it and its [rows, in_features] output is never written. None
        elsewhere: the caller runs silu and then this layer."""
        x = gate_up.reshape(-1, gate_up.shape[-1])
        found = self._fp8_quantizing(x[:, :self.in_features]) \
            if x.shape[1] == 2 * self.in_features else None
        if found is None:
            return None
        triton_gemm, args = found
        y = triton_gemm.quant_gemm(x, n=self.out_features, silu=True, **args)
        y = y if self.bias is None else y + self.bias
        return y.view(*gate_up.shape[:-1], self.out_features)

    def norm_input(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor | None, QuantizedRows] | None:
        """RMSNorm(x + delta) (layers.add_rms_norm's; without delta of x) made straight into
        this layer's input where its FP8 kernel quantizes x (`_fp8_quantizing`):
        (x + delta, or None without delta; the normed rows quantized), one kernel where there
        were a norm and a quantization pass, the norm never written out. None elsewhere (the
        caller norms, and this layer takes the result as usual)."""
        found = self._fp8_quantizing(x)
        if found is None or not x.is_contiguous() or weight.dtype != x.dtype or \
                (delta is not None and (delta.shape != x.shape or not delta.is_contiguous())):
            return None
        triton_gemm, args = found
        rows = triton_gemm.quantized_rows(x.shape[0], self.in_features, args["cublas_blocks"],
                                          x.device)
        group = triton_gemm.activation_group(self.in_features, args["scale_cols"])
        total, values, scales = triton_gemm.norm_quantize_activations(x, delta, weight, eps,
                                                                      group, rows)
        return total, QuantizedRows(values, scales, x.shape[0], x.dtype)

    def _fp8_quantizing(self, x: torch.Tensor) -> tuple[ModuleType, dict] | None:
        """(quant/triton_gemm, this layer's kernel arguments) where its FP8 kernel quantizes
        rows x [M, in_features] (from WIDE_ROWS rows of a half-precision x, where Triton reads
        e4m3: sm_89 and later); None elsewhere."""
        triton_gemm = _triton_gemm() if x.is_cuda and self.input_order is None else None
        if triton_gemm is None or x.dim() != 2 or not triton_gemm.quantizes_x(x):
            return None  # (decode's single rows leave here, before the layer's arguments)
        args = self._kernel_args()
        if args is None or args["fmt"] != triton_gemm.FP8 or not triton_gemm.supports(
                x, triton_gemm.FP8, self.in_features, args["scale_cols"], 128):
            return None
        return triton_gemm, args

    def _quantized_rows_forward(self, x: QuantizedRows) -> torch.Tensor:
        from nanoserve.quant import triton_gemm  # norm_input made x: Triton is here

        args = self._kernel_args()
        y = triton_gemm.fp8_quantized_gemm(x.values, x.scales, x.rows, args["w"], args["scales"],
                                           args["scale_row"], args["scale_cols"],
                                           self.out_features, args["cublas_blocks"], x.dtype)
        return y if self.bias is None else y + self.bias

    def _kernel_args(self) -> dict | None:
        """The kernel's view of this layer's tensors, built once (per-output scale rows)."""
        first = self.shard_view(next(iter(self.specs[0])), 0)
        key, device = first.data_ptr(), first.device
        if getattr(self, "_args_key", None) == key:
            return self._args
        # built by the eager warm-up steps: a graph capture would record its copies
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        from nanoserve.quant.triton_gemm import AWQ, FP8, GPTQ, GPTQ_ACT_ORDER
        q = self.quant
        args: dict | None
        if q.method.startswith("fp8"):
            rows, first = [], 0
            for i, n in enumerate(self.shard_sizes):
                if q.method == "fp8_block":
                    rows.append(first + torch.arange(n) // q.block[0])
                    first += self.specs[i]["weight_scale_inv"].shape[0]
                elif q.method == "fp8_channel":
                    rows.append(first + torch.arange(n))
                    first += n
                else:
                    rows.append(torch.full((n,), i))
            scales = self.weight_scale_inv if q.method == "fp8_block" else \
                self.weight_scale.reshape(-1, 1)
            args = dict(fmt=FP8, w=self.weight, scales=scales,
                        scale_row=torch.cat(rows).to(device, torch.int32),
                        scale_cols=q.block[1] if q.method == "fp8_block" else 1 << 30,
                        cublas_blocks=q.method == "fp8_block" and tuple(q.block) == (128, 128)
                        and all(n % 128 == 0 for n in self.shard_sizes))
        elif q.method == "awq":
            args = dict(fmt=AWQ, w=self.qweight, zeros=self.qzeros, scales=self.scales,
                        group=q.group_size)
        elif all(torch.equal(self.g_idx[0], g) for g in self.g_idx[1:]):
            g_idx = self.g_idx[0].contiguous()
            in_order = torch.equal(g_idx.cpu(), torch.arange(self.in_features,
                                                             dtype=g_idx.dtype) // q.group_size)
            args = dict(fmt=GPTQ if in_order else GPTQ_ACT_ORDER, w=self.qweight,
                        zeros=self.qzeros, scales=self.scales, g_idx=g_idx,
                        group=q.group_size, zero_offset=int(q.zeros_less_one))
        else:
            args = None
        self._args_key, self._args = key, args
        return args


def _triton_gemm() -> ModuleType | None:
    """quant/triton_gemm, or None on a CUDA install without Triton (the reference path)."""
    try:
        from nanoserve.quant import triton_gemm
    except ImportError:
        return None
    return triton_gemm
