"""Attention: one backend interface (backend.py) and the backends, registered here by name.

Each factory imports its backend's module when called, not before: the Triton backend needs
triton (absent from CPU-only installs), flash needs the optional flash-attn.
"""

from __future__ import annotations

from nanoserve.attention.backend import AttentionBackend
from nanoserve.attention.registry import (
    backend_names,
    register_backend,
    resolve_backend,
    select_backend,
)

__all__ = ["AttentionBackend", "backend_names", "register_backend", "resolve_backend",
           "select_backend"]

FLASH_UNTESTED = ("flash-attn's kernels have never run under this project's GPU tests, so its "
                  "output is unverified; `auto` never picks it. Use triton unless you are "
                  "the GPU run that covers it (tests/test_gpu_engine.py).")


@register_backend("torch", needs_cuda=False, auto_priority=0)
def _torch() -> AttentionBackend:
    from nanoserve.attention.torch_backend import TorchBackend

    return TorchBackend()


@register_backend("triton", needs_cuda=True, auto_priority=1)
def _triton() -> AttentionBackend:
    from nanoserve.attention.triton_backend import TritonBackend

    return TritonBackend()


@register_backend("flash", needs_cuda=True, reads_quantized_kv=False, untested=FLASH_UNTESTED)
def _flash() -> AttentionBackend:
    from nanoserve.attention.flash_backend import FlashBackend

    return FlashBackend()
