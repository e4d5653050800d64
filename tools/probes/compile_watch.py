"""Which Triton kernels compile (or load from the disk cache) during a bench run, and when:
every variant the process had not built yet is printed with its constants, and the bench's
timed prefills are marked, so that a kernel built inside a request shows. Usage (GPU):
    TORCH_LOGS=recompiles python tools/probes/compile_watch.py <bench_offload.py arguments>
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

from triton import knobs

from nanoserve.engine import prefill_progress

T0 = time.perf_counter()


def _built(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
    consts = {k: v for k, v in compile["constants"].items() if not isinstance(v, str)}
    print(f"[compile {time.perf_counter() - T0:8.2f} s] {fn.name} {consts}", flush=True)
    return False


class _Marked(prefill_progress.PrefillProgress):
    def __init__(self, *args, **kwargs) -> None:
        print(f"[timed prefill starts {time.perf_counter() - T0:8.2f} s]", flush=True)
        super().__init__(*args, **kwargs)


def main() -> None:
    knobs.runtime.jit_cache_hook = _built
    prefill_progress.PrefillProgress = _Marked
    bench = Path(__file__).parents[2] / "bench_offload.py"
    sys.argv = [str(bench), *sys.argv[1:]]
    runpy.run_path(str(bench), run_name="__main__")


if __name__ == "__main__":
    main()
