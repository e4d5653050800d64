"""Small pure tensor functions that inductor fuses into one kernel each on CUDA.

`@fused` marks such a function: on CUDA tensors it runs through `torch.compile`, elsewhere
eagerly. The token dimension is marked dynamic, so one compilation serves every token count
(1 aside); feature sizes stay static. Intermediate bf16
roundings are emulated, so a fused kernel rounds where the eager function does. The eager
function stays reachable as `.eager`: it is the reference the GPU tests hold the fused kernels
to, and what the CPU engine runs. `set_enabled(False)` (the engine's `enable_fusion=False`)
turns fusion off in this process.

The first call at a new shape class compiles (seconds); decode graphs are captured only after
a warm-up run at each size, so compilation never happens inside a capture. On Hopper (unless
NANOSERVE_PDL=0) the kernels launch with programmatic dependent launch, as the engine's own
(nanoserve/pdl.py), where this torch's inductor has the option.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_enabled = True
RECOMPILE_LIMIT = 64


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    """Whether fused kernels (these, and the hand-written ones that replace several ops) run."""
    return _enabled


def _pdl_options(device: torch.device) -> dict:
    """Inductor's kernels launched with programmatic dependent launch where the engine's are
    (sm_90 and later unless NANOSERVE_PDL=0; nanoserve/pdl.py), and where this torch has the option:
    each waits for the kernel ahead before it reads what that kernel wrote, then lets the next
    start. Decided at a function's first compile. Inductor places its wait by the buffers the
    previous kernel of its graph touched, and a kernel with no loads has none; each @fused
    function here loads its inputs and compiles to one kernel (TORCH_LOGS=output_code on an
    H200, session 32: every kernel of the PDL test's models opens with gdc_wait and
    gdc_launch_dependents)."""
    from nanoserve.extensions import pdl_wanted
    if not hasattr(torch._inductor.config.triton, "enable_pdl") or \
            not pdl_wanted(torch.cuda.get_device_capability(device)):
        return {}
    return {"triton.enable_pdl": True}


_compiled: dict[Callable, Callable] = {}  # each @fused function's compiled form, once made


def forget_compiled() -> None:
    """The next call of each @fused function compiles it again (with the options of then:
    NANOSERVE_PDL as it is then); dynamo's caches are cleared too."""
    _compiled.clear()
    torch._dynamo.reset()


def fused(fn: F) -> F:
    @functools.wraps(fn)
    def call(*args):
        if not (_enabled and args[0].is_cuda):
            return fn(*args)
        compiled = _compiled.get(fn)
        if compiled is None:
            # each model shape and dtype in a process compiles its own graphs (two: token
            # count 1, and any other); the default limit of 8 would fall back to eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       RECOMPILE_LIMIT)
            compiled = _compiled[fn] = torch.compile(fn, fullgraph=True, options={
                "emulate_precision_casts": True, **_pdl_options(args[0].device)})
        n = args[0].shape[0]
        if n > 1:  # the token dimension is dynamic from the first call on
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == n:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    call.eager = fn
    return call  # type: ignore[return-value]
