"""The kernel back-end registry: every choice point is registered, the environment override replaces what "auto"
picks (and is refused when it names no back end), explicit requests are never overridden, and each distinct
choice is logged once."""

from __future__ import annotations

import logging

import pytest
import torch

from hylo_bench.decode.linear_layer import LinearServing  # noqa: F401 (imports every decode choice point)
from hylo_bench.kernels import gated_delta, gemv, layer_glue, mla_decode, prefix_attention, registry, ssd
from hylo_bench.kernels.gated_delta import glue


def test_every_choice_point_is_registered_with_its_backends_in_priority_order():
    assert {n: c.backends for n, c in registry.CHOICES.items()} == {
        "gdn": ("fla", "torch"), "ssd": ("fla", "torch"), "mla_decode": ("triton", "torch"),
        "gemv": ("triton", "torch"), "gdn_decode": ("triton", "fla", "torch"), "gdn_prestep": ("triton", "torch"),
        "prefix_attention": ("cudnn_split", "sdpa"), "gdn_glue": ("fla", "torch"),
        "layer_glue": ("fla", "torch")}
    assert registry.CHOICES["gdn"].env == "HYLO_BENCH_GDN_BACKEND"
    assert registry.CHOICES["layer_glue"] is layer_glue.CHOICE
    assert registry.CHOICES["gdn_decode"].env == "HYLO_BENCH_GDN_DECODE_BACKEND"


def test_auto_on_cpu_picks_torch_everywhere_without_an_override(monkeypatch):
    for name in registry.CHOICES:
        monkeypatch.delenv(registry.CHOICES[name].env, raising=False)
    cpu = torch.device("cpu")
    assert gated_delta.CHOICE.choose(cpu, True, dtype=torch.float32)[0] == "torch"
    assert ssd.CHOICE.choose(cpu, False, torch.float32)[0] == "torch"
    assert mla_decode.CHOICE.choose(cpu, torch.float32)[0] == "torch"
    assert gemv.select_gemv_backend(cpu, torch.float32, True) == "torch"
    assert gated_delta.select_gdn_decode_backend(cpu, torch.float32, "auto") == "torch"
    assert gated_delta.select_prestep_backend(cpu, torch.float32, "auto", 4) == "torch"
    assert prefix_attention.CHOICE.choose(cpu, torch.bfloat16, 128, 128) == ("sdpa", "device cpu")
    assert glue.CHOICE.choose(cpu, torch.bfloat16, False) == ("torch", "device cpu")


def test_environment_override_replaces_auto_and_is_checked(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("HYLO_BENCH_SSD_BACKEND", "fla")
    assert ssd.CHOICE.choose(cpu, False, torch.float32) == ("fla", "$HYLO_BENCH_SSD_BACKEND=fla")
    monkeypatch.setenv("HYLO_BENCH_SSD_BACKEND", "AUTO")  # auto (any case) and empty mean no override
    assert ssd.CHOICE.choose(cpu, False, torch.float32)[0] == "torch"
    monkeypatch.setenv("HYLO_BENCH_GDN_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"\$HYLO_BENCH_GDN_BACKEND='cuda': expected auto or one of fla, torch"):
        gated_delta.CHOICE.choose(cpu, True, dtype=torch.float32)
    # a forced GDN decode back end is checked as an explicit request: triton needs CUDA
    monkeypatch.setenv("HYLO_BENCH_GDN_DECODE_BACKEND", "triton")
    with pytest.raises(ValueError, match="GDN decode backend 'triton' needs CUDA"):
        gated_delta.select_gdn_decode_backend(cpu, torch.float32, "auto")
    # an explicit argument is never overridden
    assert gated_delta.select_gdn_decode_backend(cpu, torch.float32, "torch") == "torch"
    monkeypatch.setenv("HYLO_BENCH_GDN_PRESTEP_BACKEND", "torch")
    assert gated_delta.select_prestep_backend(cpu, torch.float32, "auto", 4) == "torch"


def test_forced_torch_backend_runs_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("HYLO_BENCH_GDN_BACKEND", "torch")
    registry.clear_log()
    q, k = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4)
    v, g, beta = torch.randn(1, 6, 2, 3), -torch.rand(1, 6, 2), torch.rand(1, 6, 2)
    with caplog.at_level(logging.INFO, logger="hylo_bench.kernels.registry"):
        o, _ = gated_delta.gated_delta_rule(q, k, v, g, beta)
        gated_delta.gated_delta_rule(q, k, v, g, beta)
    assert [r.getMessage() for r in caplog.records] == ["GDN backend: torch chunked ($HYLO_BENCH_GDN_BACKEND=torch)"]
    ref, _ = gated_delta.gated_delta_rule_reference(q, k, v, g, beta)
    assert torch.allclose(o, ref, atol=1e-5)


def test_registering_a_name_twice_with_other_backends_is_refused():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.KernelChoice("gdn", "x", ("torch",), lambda: ("torch", "")))
