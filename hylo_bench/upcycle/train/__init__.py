"""The training loop of ``upcycle``: one stage of Enhanced-ILD or KL distillation (``trainer``), its losses
(``losses``: layer-wise L2, chunked forward KL) and its per-step log / MFU (``metrics``)."""
