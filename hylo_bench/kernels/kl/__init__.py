"""Forward-KL distillation losses: the full-logit reference and the chunked hidden-state kernel.

``chunked_kl_div`` is the training loss (stage II, training-recipe.md sec. 3.2); ``kl_div_reference`` is its
ground truth. Both return ``T**2 * mean over valid tokens of KL(p_t || p_s)``.
"""

from hylo_bench.kernels.kl.chunked import chunked_kl_div
from hylo_bench.kernels.kl.reference import kl_div_reference

__all__ = ["chunked_kl_div", "kl_div_reference"]
