"""Run vLLM greedy decoding on an exported HyLo model and print one JSON object (for tests and scripts).

``python -m hylo_bench.serving.vllm_plugin.greedy MODEL_DIR --prompts '[[1, 2, 3]]' --max-tokens 8``
(run with the Python of an environment that has vLLM; vLLM loads the plugin through its entry point).

Output keys: ``tokens`` (list of generated id lists, one per prompt), ``logprobs`` (per prompt, per step a
``{token_id: logprob}`` of the top ``--logprobs`` tokens; empty lists without it), ``tokens_alone`` /
``logprobs_alone`` (the same, each prompt run by itself afterwards; empty without ``--also-alone``), ``num_blocks``,
``block_size``,
``kv_cache_size_tokens``, ``use_mla``, ``is_hybrid``, ``max_model_len``, ``startup_s``, ``generate_s``,
``vllm_version``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    ap.add_argument("--ssm-dtype", default="float32", help="mamba_ssm_cache_dtype (GDN recurrent state)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="requests batched together")
    ap.add_argument("--executor", default=None, help="distributed_executor_backend (e.g. uni: worker in-process)")
    ap.add_argument("--logprobs", type=int, default=0, help="also return the top-K logprobs of every step")
    ap.add_argument("--stagger", action="store_true",
                    help="submit the first prompt alone and the others once it has a token, so that its decode shares "
                         "steps with their prefills (mixed decode + prefill batches)")
    ap.add_argument("--also-alone", action="store_true",
                    help="then run every prompt alone on the same engine (keys tokens_alone, logprobs_alone)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=args.max_model_len,
              enforce_eager=True, enable_prefix_caching=False, kv_cache_memory_bytes=args.kv_cache_bytes,
              mamba_ssm_cache_dtype=args.ssm_dtype, max_num_seqs=args.max_num_seqs, seed=0,
              distributed_executor_backend=args.executor)
    t1 = time.perf_counter()
    prompts = [{"prompt_token_ids": list(p)} for p in json.loads(args.prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                        logprobs=args.logprobs or None)
    outs = _generate_staggered(llm, prompts, sp) if args.stagger else llm.generate(prompts, sp, use_tqdm=False)
    t2 = time.perf_counter()
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts] if args.also_alone else []
    vc = llm.llm_engine.vllm_config
    cc, mc = vc.cache_config, vc.model_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs], "logprobs": _logprobs(outs),
        "tokens_alone": [list(o.outputs[0].token_ids) for o in alone], "logprobs_alone": _logprobs(alone),
        "num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
        "mamba_block_size": getattr(cc, "mamba_block_size", None),
        "mamba_page_size_padded": getattr(cc, "mamba_page_size_padded", None),
        "kv_cache_size_tokens": getattr(cc, "kv_cache_size_tokens", None),
        "use_mla": bool(mc.use_mla), "is_hybrid": bool(mc.is_hybrid), "max_model_len": mc.max_model_len,
        "startup_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 3), "vllm_version": vllm.__version__,
    }
    sys.stdout.write("HYLO_VLLM_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def _logprobs(outs: list) -> list[list[dict[str, float]]]:
    return [[{str(t): float(lp.logprob) for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])]
            for o in outs]


def _generate_staggered(llm, prompts: list[dict], sp) -> list:
    """Greedy outputs in prompt order; prompt 0 is submitted first and the rest after its first token.

    Requests are named "0", "1", ... (vLLM may add a suffix internally; outputs carry either name).

    Raises:
        RuntimeError: if the engine stops stepping before every request finished.
    """
    eng = llm.llm_engine
    names: dict[str, str] = {}  # any id vLLM may report -> our name

    def add(i: int, prompt: dict) -> None:
        names[str(i)] = str(i)
        names[str(eng.add_request(str(i), prompt, sp))] = str(i)

    done: dict[str, object] = {}

    def step() -> list:
        outs = eng.step()
        done.update({names.get(o.request_id, o.request_id): o for o in outs if o.finished})
        return outs

    add(0, prompts[0])
    while eng.has_unfinished_requests():  # until prompt 0 has its first token (its prefill ran)
        if any(names.get(o.request_id) == "0" and o.outputs and o.outputs[0].token_ids for o in step()):
            break
    for i, p in enumerate(prompts[1:], start=1):
        add(i, p)
    while eng.has_unfinished_requests():
        step()
    missing = [str(i) for i in range(len(prompts)) if str(i) not in done]
    if missing:
        raise RuntimeError(f"vLLM finished without outputs for requests {missing} (got {sorted(done)})")
    return [done[str(i)] for i in range(len(prompts))]


if __name__ == "__main__":
    raise SystemExit(main())
