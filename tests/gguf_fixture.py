"""A tiny Llama written as a GGUF file (float32 tensors, a byte-level BPE tokenizer, a ChatML template), so the
GGUF path of every command runs in tests without the real model.

The tensor names and the rotary permutation of q / k are llama.cpp's conventions for Llama (its converter writes
W_q and W_k with each head's rotary halves interleaved, which transformers' GGUF loader undoes): with them the
file loads back to the same weights as the Hugging Face model it was written from.
"""

from __future__ import annotations

import json

import numpy as np

CHATML = ("{% for m in messages %}{{ '<|bos|>' + m['role'] + '\n' + m['content'] + '<|eos|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}")


def _interleave_rotary_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """[n_heads * d, in] with each head's rows (first half, second half) -> rows (h0[0], h1[0], h0[1], ...)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path, model, tokenizer) -> None:
    """Write an HF ``LlamaForCausalLM`` (untied head) and its byte-level BPE tokenizer as a GGUF file."""
    from gguf import GGUFWriter

    c = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    tok = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {a["content"] for a in tok.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control, 1 = normal
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(CHATML)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight",
                     _interleave_rotary_halves(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight",
                     _interleave_rotary_halves(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
