"""Runs a scheduled batch: its inputs built once, the step executor eagerly or a decode graph's
replay, then the sampler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve import fused
from nanoserve.attention import select_backend
from nanoserve.attention.prefill import PREFIX_PIECE, merge_partials, merge_with_lse
from nanoserve.config import EngineConfig
from nanoserve.context import forward_context
from nanoserve.distributed.parallel_state import agree_min, broadcast_from_rank0, tp_size
from nanoserve.distributed.workers import TensorParallelFailure, TPWorkers
from nanoserve.engine.cpu_split_setup import build_cpu_share
from nanoserve.engine.grammar import MaskBuffers
from nanoserve.engine.graph_runner import DecodeGraphRunner
from nanoserve.engine.prompt_logprobs import (
    ROWS_PER_HEAD_CALL,
    read_scores,
    score_rows,
    slice_scores,
)
from nanoserve.engine.sampler import build_sampling_tensors, sample, sample_on_device
from nanoserve.engine.scheduler import Batch
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.step_executor import StepExecutor, StepState
from nanoserve.engine.step_inputs import HostStep, InFlightTokens, StepInputBuilder, StepInputs
from nanoserve.engine.token_stats import TokenStats
from nanoserve.kv.fp8 import dequantize
from nanoserve.kv.fp8_format import FP8, check_device_reads_fp8
from nanoserve.kv.manager import GiB, KVBudget, KVManager, bind_kv, default_host_budget_gib
from nanoserve.kv.pages import pages_needed
from nanoserve.kv.spec import KVSpec
from nanoserve.models import cuda_moe
from nanoserve.models.decoder import CausalLM
from nanoserve.models.layers import SKINNY_MIN_COLUMNS, Linear
from nanoserve.models.loader import load_model
from nanoserve.models.moe import SparseMoE
from nanoserve.quant import QuantizedLinear, cuda_gemv
from nanoserve.sampling_params import SamplingParams


@dataclass
class LaunchedStep:
    """A decode step whose kernels are queued and whose tokens the host has not read yet.
    Launched unsampled (a grammar's mask waits for the step before), it holds its logits
    until ModelRunner.sample_launched queues the sampling."""
    batch: Batch
    positions: list[int]  # each row's token position (its seed's uniform)
    logits: torch.Tensor | None = None  # until sampled
    tokens: InFlightTokens | None = None  # on device: the next step's input ids
    host_tokens: torch.Tensor | None = None  # on cpu (pinned on CUDA): filled once `done`
    done: torch.cuda.Event | None = None


def build_worker_runner(cfg: EngineConfig, model_dir: Path, max_model_len: int,
                        device: torch.device) -> ModelRunner:
    """A tensor-parallel worker's runner (TPWorkers' build_runner): its shard of the model,
    loaded on its device, and the same start-up as rank 0's."""
    model = load_model(model_dir, max_model_len, cfg.torch_dtype, device, cfg.dummy_weights,
                       cfg.seed, progress=False)
    return ModelRunner(cfg, model, max_model_len, progress=False)


# token counts of the warm-up prompts (ModelRunner.warm_up_prompts); the classes of count that
# compiled kernels may specialize on: not divisible by 16 (even, odd) and divisible by 16. A
# last prompt fills a whole step (warm_up_lengths): kernels that pick tiles by size band (the
# fused MoE's prefill tiles, from 4,096 (token, expert) pairs) compile for long prompts too
WARM_UP_PROMPT_LENGTHS = (90, 131, 160)


def warm_up_lengths(step_tokens: int) -> list[int]:
    """The warm-up prompts' lengths when a step holds `step_tokens` prompt tokens. A one-token
    prompt first: dynamo specializes the fused functions at one token, the count an eager
    engine's batch-1 decode step runs them at (it has no graph warm-up; its first decode step
    compiled three graphs inside a request)."""
    lengths = [1] + [min(n, step_tokens) for n in WARM_UP_PROMPT_LENGTHS]
    return lengths + [step_tokens] if step_tokens > max(lengths) else lengths


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model: CausalLM, max_model_len: int,
                 progress: bool = True, peers: TPWorkers | None = None) -> None:
        """peers: under tensor parallelism, rank 0's workers (each step's inputs go to them);
        None on the workers themselves and without TP. Every rank builds its runner through
        this same code, so their start-up collectives pair up."""
        self.cfg, self.model, self.peers = cfg, model, peers
        self._worker_tokens: InFlightTokens | None = None  # a TP worker's last launched ids
        self.mcfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = max_model_len
        fused.set_enabled(cfg.enable_fusion)
        model.set_moe_backend(cfg.moe_backend)
        kv_dtype = cfg.torch_kv_dtype
        if kv_dtype == FP8:
            check_device_reads_fp8(self.device)
        self.backend = select_backend(cfg.attention_backend, self.device, kv_dtype == self.dtype)
        num_kv_heads = model.attention_layers[0].num_kv_heads  # this rank's share under TP
        self.backend.configure(num_kv_heads, max_model_len)
        for attn in model.attention_layers:
            attn.backend = self.backend
        self.token_stats = TokenStats(self.mcfg.vocab_size, cfg.max_num_seqs, self.device)
        self.mask_buffers = MaskBuffers(self.mcfg.vocab_size)

        spec = KVSpec(self.mcfg.num_layers, cfg.page_size, num_kv_heads, self.mcfg.head_dim,
                      kv_dtype)
        max_pages_per_seq = pages_needed(max_model_len, cfg.page_size)
        # the host budget is the machine's, shared by the ranks; the GPU budget is per GPU;
        # every rank takes the smallest figure, so all plan the same pages and layers
        host_gib = (cfg.host_kv_budget_gib or default_host_budget_gib()) / tp_size() if \
            cfg.enable_offload else 0.0
        budget = KVBudget(agree_min(self._gpu_budget_bytes(spec)),
                          agree_min(int(host_gib * GiB)), cfg.enable_offload,
                          cfg.max_num_seqs, max_pages_per_seq, cfg.num_kv_buffers,
                          cfg.resident_layers)
        self.kv = KVManager(spec, budget, self.device, cfg.enable_prefix_caching)
        self.kv.bind(model.attention_layers)
        streaming = self.kv.streamer is not None
        attn = model.attention_layers[0]
        self.cpu_share, self.cpu_split = build_cpu_share(
            cfg.cpu_attention, cfg.cpu_attention_fraction, self.kv, attn.num_heads,
            attn.head_dim, attn.scale, cfg.max_num_seqs, self.backend.merges_cpu_share)
        self.inputs = StepInputBuilder(cfg.page_size, self.device,
                                       self.kv.tail_row if streaming else None,
                                       self.cpu_split, spec.page_bytes(1))
        self.executor = StepExecutor(model, self.kv.streamer, self.kv.plan.resident_layers,
                                     self.cpu_share)
        if self.cpu_share is not None and self.cpu_split.fixed is None:
            self.cpu_share.on_step = self._calibrate_split
        if self.device.type == "cuda":
            self._load_one_row_kernels()
            self._compile_prefill_kernels(spec)
            self.build_prefill_plans(progress)
            self.backend.build_decode_kernels(attn.num_heads, attn.num_kv_heads,
                                              self.mcfg.head_dim, self.dtype, kv_dtype,
                                              self.device)
        self.graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and not cfg.enforce_eager and \
                self.backend.supports_graphs:
            self.graphs = DecodeGraphRunner(
                self.executor, self.backend, min(cfg.max_graph_batch_size, cfg.max_num_seqs),
                max_pages_per_seq, cfg.page_size, self.device, progress)

    def _calibrate_split(self, gap: float, work: float, tokens: int) -> None:
        """A decode step's CPU share figures refine the split (offload/cpu_split.py)."""
        nbytes = tokens // self.cfg.page_size * self.kv.spec.page_bytes(1)
        loaded = self.kv.streamer.bytes_loaded // self.kv.plan.streamed_layers  # that step's
        self.inputs.cpu_split = self.inputs.cpu_split.calibrated(gap, work, nbytes, loaded)

    def _load_one_row_kernels(self) -> None:
        """Builds or loads the one-row CUDA kernels this model's batch-1 decode takes (AWQ and
        FP8 layers, 16-bit layers narrower than the skinny matmul takes, MoE experts) now: an
        eager engine has no graph warm-up, and its first decode step would build them inside a
        request (nvcc: up to a minute)."""
        layers = list(self.model.modules())
        if any(isinstance(m, QuantizedLinear) and
               (m.quant.method == "awq" or m.quant.method.startswith("fp8")) for m in layers) \
                or any(isinstance(m, Linear) and m.bias is None and
                       m.out_features < SKINNY_MIN_COLUMNS and m.weight.dtype in cuda_gemv.HALF
                       for m in layers):
            cuda_gemv.load()
        if any(isinstance(m, SparseMoE) for m in layers):
            cuda_moe.load()

    @torch.inference_mode()  # as requests run: grad mode is in dynamo's guards
    def _compile_prefill_kernels(self, spec: KVSpec) -> None:
        """Compiles the prefill merges (a prefix in one piece and in several: attention/
        prefill.py) and FP8's dequantize, for any token count and for one, now, not in the
        first request that has a cached prefix (the other fused kernels compile in graph
        capture and in the engine's warm-up prompts, warm_up_prompts, which have no prefix)."""
        heads = self.model.attention_layers[0].num_heads
        for n in (2, 1):
            # distinct tensors, as a request passes: one passed twice would compile a graph
            # guarded on the two being the same, and the request's call would compile again
            o, o2 = (torch.zeros(n, heads, self.mcfg.head_dim, dtype=self.dtype,
                                 device=self.device) for _ in range(2))
            lse, lse2 = (torch.zeros(n, heads, device=self.device) for _ in range(2))
            merge_partials(o, lse, o2, lse2)
            parts = merge_with_lse(o, lse, o2, lse2)
            parts = merge_with_lse(*parts, o, lse)
            merge_partials(o, lse, *parts)
        if spec.quantized:
            for n in (2, 1):
                values = torch.zeros(n, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype,
                                     device=self.device)
                dequantize(values, torch.ones(n, spec.num_kv_heads, device=self.device),
                           self.dtype)

    def warm_up_prompts(self) -> None:
        """Runs a few prompt steps through the real step path now, so that the engine's first
        requests do not compile. The memory-profiling prefill runs at one length outside that
        path, and a fresh engine's first prompt still compiled the fused prefill functions
        (dynamo and inductor; H200, Qwen3-8B: 1.1 s under cProfile for 3,958 tokens, 0.449 s
        without, against 0.101 s once warm), and its second new length again (0.35 s).
        Greedy and sampled, so both samplers' kernels are built too. Leaves no pages taken.
        Under TP it runs on rank 0 after the workers are ready: its steps reach them as any
        step does."""
        n_max = min(self.cfg.max_num_batched_tokens, self.max_model_len - 1)
        if n_max < 1:  # no prompt fits beside its first token
            return
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        for i, n in enumerate(warm_up_lengths(n_max)):
            p = sampled if i % 2 else greedy
            # the first (one token) is a chunk of a longer prompt: it samples no row, as a long
            # prompt's chunks but its last do (the head's fused norm then runs at zero rows,
            # another count dynamo specializes)
            seq = Sequence([0] * (n + (i == 0)), p)
            if not self.kv.grow(seq, n):
                return
            try:
                self.run(Batch(True, [seq], [n]))
            finally:
                self.kv.free(seq)
                self.release(seq.seq_id)

    def build_prefill_plans(self, progress: bool = False) -> None:
        """Builds what the attention backend's prefill builds per shape (cuDNN's plans, cached
        per thread) on the calling thread, for every chunk a step can hold."""
        attn = self.model.attention_layers[0]
        self.backend.build_prefill_plans(
            attn.num_heads, attn.num_kv_heads, self.mcfg.head_dim, self.dtype, self.device,
            min(self.cfg.max_num_batched_tokens, self.max_model_len), progress)

    def release(self, seq_id: int) -> None:
        """A sequence finished: drop its per-sequence sampling state."""
        self.token_stats.release(seq_id)

    # --- sizing -------------------------------------------------------------------------------
    def _gpu_budget_bytes(self, spec: KVSpec) -> int:
        if self.cfg.gpu_kv_budget_gib is not None:
            return int(self.cfg.gpu_kv_budget_gib * GiB)
        if self.device.type == "cuda":
            return self._profile_free_bytes(spec)
        return GiB  # CPU: enough for tests and the embedded model

    def _profile_free_bytes(self, spec: KVSpec) -> int:
        """KV bytes left after the model and a prefill of the largest chunk (its activations)
        after a prefix of a piece (attention/prefill.py reads a longer one piece by piece)."""
        # a mixed step: a full chunk and a decode row per running sequence
        n = min(self.cfg.max_num_batched_tokens + self.cfg.max_num_seqs, self.max_model_len)
        prefix = min(PREFIX_PIECE, self.max_model_len - n)
        num_pages = pages_needed(prefix + n, spec.page_size) + 1
        # one layer's scratch KV, read by every layer: the KV pool has its own budget
        scratch = spec.empty(1, num_pages, self.device)
        bind_kv(self.model.attention_layers, spec, [scratch[0]] * spec.num_layers)
        torch.cuda.reset_peak_memory_stats()
        seq = Sequence([0] * (prefix + n), SamplingParams(max_tokens=1))
        seq.num_cached = prefix
        seq.pages = list(range(1, num_pages))
        inputs = StepInputBuilder(spec.page_size, self.device).build(Batch(True, [seq], [n]))
        ctx = inputs.context()
        self.backend.prepare(ctx)
        with forward_context(ctx):
            hidden = self.model(inputs.input_ids, inputs.positions)
            rows = torch.arange(min(n, ROWS_PER_HEAD_CALL), device=self.device)
            # the largest head call a step makes: prompt scoring's
            score_rows(self.model.head, hidden, None, rows, torch.zeros_like(rows), 1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        others = total - free - torch.cuda.memory_reserved()  # other processes, CUDA context
        graph_reserve = GiB // 2 + 4 * self.cfg.max_graph_batch_size * self.mcfg.vocab_size * 4
        return int(total * self.cfg.gpu_memory_utilization - others - peak - graph_reserve)

    # --- steps --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int | None]:
        """Sampled token per sequence; None for a prompt chunk that does not end its prompt."""
        n = len(batch.seqs)
        graphs = self._graphs_for(batch.is_prefill, n)
        step = self.inputs.plan(batch, graphs.padded_size(n) if graphs else None)
        logits, inputs = self._forward_everywhere(step)
        scores = [None] * n if inputs.prompt_scores is None else slice_scores(
            inputs.prompt_scores, step.arrays["score_ids"].tolist(), step.score_counts,
            [s.params.prompt_logprobs for s in batch.seqs])
        seqs = [s for s, yes in zip(batch.seqs, step.samples, strict=True) if yes]
        if not seqs:  # nothing read back: prompt scores stay on the device for now
            batch.unread_scores = scores
            return [None] * n
        # logits come from the model's dtype: a half-precision model's are exact in it
        key_dtype = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else None
        out = sample(logits, build_sampling_tensors(seqs, self.mcfg.vocab_size, self.device,
                                                    self.inputs.pin, self.token_stats,
                                                    mask_buffers=self.mask_buffers),
                     key_dtype)
        if any(scores) or any(s.unread_scores for s in batch.seqs):  # the step has synchronized
            batch.prompt_logprobs = read_scores([s.unread_scores + ([u] if u else [])
                                                 for s, u in zip(batch.seqs, scores, strict=True)])
        tokens = iter(out.token_ids)
        logprobs = iter(out.logprobs or [None] * len(seqs))
        batch.logprobs = [next(logprobs) if yes else None for yes in step.samples]
        return [next(tokens) if yes else None for yes in step.samples]

    def _forward_everywhere(self, step: HostStep, in_flight: InFlightTokens | None = None
                            ) -> tuple[torch.Tensor, StepInputs]:
        """The step's forward here, and under TP on every worker (sent first): its logits, and
        its inputs with what the forward set in them (prompt scores)."""
        if self.peers is not None:
            self.peers.send(step)
        try:
            inputs = step.to_device(self.device, self.inputs.pin, in_flight)
            return self.forward(inputs), inputs
        except Exception as e:
            if self.peers is None:
                raise
            # the workers run theirs: the ranks are out of step for good
            raise TensorParallelFailure(f"a step failed on rank 0 after its workers took it: "
                                        f"{type(e).__name__}: {e}") from e

    @torch.inference_mode()
    def execute(self, step: HostStep) -> None:
        """A worker's share of a step rank 0 runs (tensor parallelism): the same forward, no
        sampling. A launched step's ids arrive from rank 0 (async scheduling): the next step's
        rows that wait for them take them on the device, as rank 0's do."""
        in_flight = self._worker_tokens if step.uses_in_flight else None
        self.forward(step.to_device(self.device, self.inputs.pin, in_flight))
        if step.shares_tokens:
            rows = len(step.samples)
            tokens = torch.empty(rows, dtype=torch.int64, device=self.device)
            self._worker_tokens = InFlightTokens(broadcast_from_rank0(tokens), {})

    @torch.inference_mode()
    def launch(self, batch: Batch, in_flight: InFlightTokens | None,
               sample: bool = True) -> LaunchedStep:
        """Queues a decode step (inputs, forward and, with `sample`, sampling) and returns
        without waiting for it: async scheduling. Sequences still waiting for `in_flight`'s
        tokens take them on the device. No logprobs, no penalties (both read the host's view of
        the tokens). Without `sample` the caller queues the sampling (sample_launched) once
        the host knows what it needs: a grammar's mask needs the token in flight."""
        n = len(batch.seqs)
        graphs = self._graphs_for(batch.is_prefill, n)
        step = self.inputs.plan(batch, graphs.padded_size(n) if graphs else None,
                                in_flight.rows if in_flight is not None else None)
        step.shares_tokens = self.peers is not None
        logits, _ = self._forward_everywhere(step, in_flight)
        launched = LaunchedStep(batch, [s.num_tokens + s.num_pending for s in batch.seqs],
                                logits)
        if sample:
            self.sample_launched(launched)
        return launched

    @torch.inference_mode()
    def sample_launched(self, step: LaunchedStep) -> None:
        """Queues a launched step's sampling and its tokens' copy to the host. Its host work
        (grammar masks) overlaps the step's forward."""
        key_dtype = self.dtype if self.dtype in (torch.bfloat16, torch.float16) else None
        try:
            t = build_sampling_tensors(step.batch.seqs, self.mcfg.vocab_size, self.device,
                                       self.inputs.pin, positions=step.positions,
                                       mask_buffers=self.mask_buffers)
        except Exception:
            # the host's work for the step's requests (a grammar's mask) failed: the workers,
            # waiting in the tokens' broadcast, take placeholders and the step is dropped (the
            # engine reruns its sequences), so the ranks stay in step
            if self.peers is not None:
                broadcast_from_rank0(torch.zeros(step.logits.shape[0], dtype=torch.int64,
                                                 device=self.device))
            raise
        try:
            tokens = broadcast_from_rank0(sample_on_device(step.logits, t, key_dtype))
        except Exception as e:
            if self.peers is not None:  # the workers wait in the tokens' broadcast: out of step
                raise TensorParallelFailure(f"a step's sampling failed on rank 0: "
                                            f"{type(e).__name__}: {e}") from e
            raise
        step.logits, step.host_tokens = None, tokens
        if tokens.is_cuda:
            step.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            step.host_tokens.copy_(tokens, non_blocking=True)
            step.done = torch.cuda.Event()
            step.done.record()
        step.tokens = InFlightTokens(tokens, {s.seq_id: i for i, s in enumerate(step.batch.seqs)})

    def collect(self, step: LaunchedStep) -> list[int]:
        """A launched step's tokens, waiting for the step to finish."""
        if step.done is not None:
            step.done.synchronize()
        return step.host_tokens.tolist()

    def _graphs_for(self, is_prefill: bool, num_seqs: int) -> DecodeGraphRunner | None:
        if is_prefill or self.graphs is None or not self.graphs.can_run(num_seqs):
            return None
        return self.graphs

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of the rows that sample (prefill) or of the batch's sequences (decode):
        a decode graph's replay where one is captured for the batch, else eager."""
        graphs = self._graphs_for(inputs.is_prefill, inputs.num_seqs)
        if graphs is not None:
            return graphs.run(inputs)[:inputs.num_seqs]
        return self._forward_eager(inputs)

    def _forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        ctx = inputs.context()
        if inputs.offload is not None and inputs.offload.cpu_tokens is not None:
            ctx.cpu_share = self.cpu_share
        for part in ctx.prepared_parts():
            self.backend.prepare(part)
        score = None if inputs.score_rows is None else \
            (inputs.score_rows, inputs.score_ids, inputs.score_k)
        state = StepState(inputs.input_ids, inputs.positions, inputs.sample_rows, score=score)
        with forward_context(ctx):
            self.executor.run(self.executor.segments(state), inputs.offload,
                              inputs.num_seqs if ctx.cpu_share is not None else None)
        inputs.prompt_scores = state.scores
        return state.logits
