"""L2 prefetch for the decode kernels' programmatic-dependent-launch window. CUDA (sm_90+) only; imported by the
Triton kernel modules.

With PDL (:mod:`hylo_bench.kernels.pdl`) a kernel's programs start while the kernel before it drains, and wait for it
with ``gdc_wait``. Before that wait they may read only what the previous kernel does not write: a GEMV's weights,
the MLA cache rows of earlier tokens. Loading into registers covers a tile or two per program; asking L2 for the rest
of the program's data (PTX ``prefetch.global.L2``: no registers, nothing waits for it) keeps HBM busy through the
previous kernel's tail, when its last programs leave most multiprocessors idle, and the loads after the wait hit L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

# bytes per L2 line (NVIDIA Hopper and earlier): one prefetch per line
LINE_BYTES = 128


def line_elements(element_size: int) -> int:
    """Elements of ``element_size`` bytes in one L2 line (the prefetch stride, a kernel constexpr)."""
    return max(1, LINE_BYTES // element_size)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 to fetch the line holding each pointer of ``ptrs`` (any shape; every pointer must lie inside an
    allocation: clamp, do not mask). A hint: no value returns and the program does not wait for it. Replicated
    elements (a tensor smaller than the program's threads) issue duplicate requests, which L2 merges."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
