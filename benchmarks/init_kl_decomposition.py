"""Where the upcycled demo student's init KL comes from (CPU, the shipped demo teacher, about 2 minutes).

Issue 2 asks that the upcycled model's KL to its teacher before any training be 10x below a random init's. This
script splits the init KL of the demo layout (MLA at 1, 3; GDN at 0, 2) by layer and by cause:

1. ``swap``: the teacher with some attention layers replaced by the student's initialised mixer (SVD-initialised
   MLA, checkpoint-format.md section 7.1, or GDN from q/k/v/o, section 7.4); every other layer stays the teacher's.
2. ``ablate``: the teacher's own attention in one layer, changed in one way that the MLA init imposes: RoPE kept
   only on some rotate-half frequency pairs (the others unrotated, as MLA's nope dims are), and/or the rotated
   key dims averaged over the KV heads (MLA's one shared rope key, ``k_pe``).

Records: ``{"kind": "swap"|"ablate"|"reference", "name", "layers" ("1,3"), "kl_demo_windows", "kl_text"}``, KL in
nats/token (``hylo_bench.upcycle.train.losses.eval_kl``) on held-out demo windows (seed 123457, as
``tests/upcycle/test_demo_init.py``) and on the last 5 % of the shipped text. Writes
``benchmarks/results/init_kl_decomposition.json``. Usage: ``python benchmarks/init_kl_decomposition.py``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result  # noqa: E402

from hylo_bench.config.student import hybrid_config_for  # noqa: E402
from hylo_bench.models.hybrid import HyLoForCausalLM  # noqa: E402
from hylo_bench.upcycle.transfer import init_student  # noqa: E402


class MixerAsAttention(torch.nn.Module):
    """A student mixer behind the teacher's attention interface: ``forward(hidden_states, **kw) -> (out, None)``."""

    def __init__(self, mixer: torch.nn.Module, kind: str):
        super().__init__()
        self.mixer, self.kind = mixer, kind

    def forward(self, hidden_states: torch.Tensor, **_: object) -> tuple[torch.Tensor, None]:
        B, T, _ = hidden_states.shape
        if self.kind == "mla":
            out, _ = self.mixer(hidden_states, torch.arange(T)[None].expand(B, T), None, cache=None, use_cache=False)
        else:
            out, _ = self.mixer(hidden_states, attention_mask=None, state=None, use_cache=False)
        return out, None


class AblatedAttention(torch.nn.Module):
    """The teacher's attention (HF rotate-half RoPE) with RoPE only on the pairs in ``rotated`` [d_h/2] (bool) and,
    with ``share_rotated_key``, the rotated key dims averaged over the KV heads."""

    def __init__(self, attn: torch.nn.Module, cfg, rotated: torch.Tensor, share_rotated_key: bool):
        super().__init__()
        self.attn, self.rotated, self.share = attn, rotated, share_rotated_key
        self.H, self.KV, self.Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        theta = cfg.rope_parameters["rope_theta"]
        self.freqs = theta ** (-2 * torch.arange(self.Dh // 2, dtype=torch.float64) / self.Dh)

    def forward(self, hidden_states: torch.Tensor, **_: object) -> tuple[torch.Tensor, None]:
        a, H, KV, Dh = self.attn, self.H, self.KV, self.Dh
        B, T, _ = hidden_states.shape
        q = a.q_proj(hidden_states).view(B, T, H, Dh).transpose(1, 2)
        k = a.k_proj(hidden_states).view(B, T, KV, Dh).transpose(1, 2)
        v = a.v_proj(hidden_states).view(B, T, KV, Dh).transpose(1, 2)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * self.freqs[None] * self.rotated[None].double()
        cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()

        def rope(x: torch.Tensor) -> torch.Tensor:
            return x * cos + torch.cat([-x[..., Dh // 2:], x[..., : Dh // 2]], -1) * sin

        if self.share:
            k = torch.where(torch.cat([self.rotated] * 2), k.mean(1, keepdim=True).expand_as(k), k)
        q, k = rope(q), rope(k).repeat_interleave(H // KV, 1)
        o = F.scaled_dot_product_attention(q, k, v.repeat_interleave(H // KV, 1), is_causal=True)
        return a.o_proj(o.transpose(1, 2).reshape(B, T, H * Dh)), None


def main() -> None:
    from hylo_bench.models.loading import load_causal_lm, load_tokenizer
    from hylo_bench.upcycle.data import build_windows, text_windows
    from hylo_bench.upcycle.documents import shipped_text, split_documents
    from hylo_bench.upcycle.train.losses import eval_kl

    teacher, info = load_causal_lm("demo", "cpu", torch.float32)
    teacher.requires_grad_(False)
    tok = load_tokenizer(info["path"])
    data = {"kl_demo_windows": build_windows("demo", tok, 512, 4, seed=123_457),
            "kl_text": text_windows(split_documents(shipped_text())[-200:], tok, 512)[:4]}
    n = teacher.config.num_hidden_layers
    students = {}
    for kind, mla in (("mla", list(range(n))), ("gdn", [])):
        torch.manual_seed(0)
        students[kind] = init_student(teacher, hybrid_config_for(teacher.config, mla)).eval()
    doc = result_envelope("init_kl_decomposition")
    doc.update(teacher="shipped demo teacher (Llama, 4 layers, 4 heads x 32, 2 KV heads, rope_theta 1e4)",
               demo_layout={"mla_layers": [1, 3], "gdn_layers": [0, 2]})
    out = Path(__file__).parent / "results" / "init_kl_decomposition.json"

    def record(kind: str, name: str, layers: list[int], model: torch.nn.Module) -> None:
        rec = {"kind": kind, "name": name, "layers": ",".join(map(str, layers)),
               **{key: round(eval_kl(model, teacher, w), 4) for key, w in data.items()}}
        doc["records"].append(rec)
        write_result(out, doc)
        print(rec, flush=True)

    torch.manual_seed(0)
    record("reference", "random init, demo layout", [], HyLoForCausalLM(hybrid_config_for(teacher.config, [1, 3])))
    torch.manual_seed(0)
    record("reference", "upcycled init, demo layout", [], init_student(teacher, hybrid_config_for(teacher.config,
                                                                                                  [1, 3])))
    swaps = [("mla", [1, 3]), ("gdn", [0, 2])] + [("mla", [i]) for i in range(n)] + [("gdn", [i]) for i in range(n)]
    for kind, layers in swaps:
        t = copy.deepcopy(teacher)
        for i in layers:
            t.model.layers[i].self_attn = MixerAsAttention(students[kind].model.layers[i].mixer, kind)
        record("swap", f"{kind} init at {layers}", layers, t)
    P = teacher.config.head_dim // 2
    pairs = {"all pairs": torch.ones(P, dtype=torch.bool), "even pairs": torch.arange(P) % 2 == 0,
             "highest-frequency half": torch.arange(P) < P // 2, "none": torch.zeros(P, dtype=torch.bool)}
    for layer in (1, 3):
        for pname, rotated in pairs.items():
            for share in (False, True):
                if pname == "none" and share:
                    continue
                t = copy.deepcopy(teacher)
                t.model.layers[layer].self_attn = AblatedAttention(teacher.model.layers[layer].self_attn,
                                                                   teacher.config, rotated, share)
                record("ablate", f"RoPE on {pname}" + (", rotated key shared over KV heads" if share else ""),
                       [layer], t)


if __name__ == "__main__":
    main()
