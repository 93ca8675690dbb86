"""Decoding on token ids, shared by ``tasks/`` and ``serving/``: the native engine (``engine``: preallocated
caches, chunked prefill, absorbed MLA decode, CUDA graphs) with its per-mixer decode (``mla_layer``,
``linear_layer``), merged GEMVs (``fused``) and ``torch.library`` custom ops (``ops``); greedy decoding through
``generate()`` or the engine (``greedy``)."""
