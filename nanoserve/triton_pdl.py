"""The device side of pdl.py: the first statement of every hand-written kernel."""

import triton
import triton.language as tl


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Waits for the previous kernel on the stream to finish and its writes to be visible, then
    lets the next kernel's programs be scheduled (pdl.py's invariant: nothing before this
    touches another kernel's memory). A no-op when the launch is not PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
