"""Real-run data: recipes carry their hub mixture (offline: the dataset is named, nothing else is used), the demo
text is refused for a real base, disabled sources are never drawn, column-mapped conversations."""

from __future__ import annotations

import json

import pytest
import yaml

from hylo_bench.config.mixture import parse_mixture
from hylo_bench.config.upcycle import UpcycleConfig, check_demo_data, upcycle_config_from_recipe, validate_config
from hylo_bench.upcycle.mixture import MixtureSampler, load_mixture


def test_every_released_recipe_carries_the_model_card_mixture():
    from hylo_bench.config import recipes as R

    for name in R.list_recipes():
        r = R.load_recipe(name)
        mix = parse_mixture(r.data, name)
        assert [s.hub for s in mix.sources] == ["JunxiongWang/sftdatasetv3"] and mix.sources[0].weight == 1.0
        assert [s.hub for s in mix.disabled] == ["nvidia/OpenMathInstruct-2", "open-thoughts/OpenThoughts-114k",
                                                 "open-r1/OpenR1-Math-220k", "nvidia/ChatQA2-Long-SFT-data"]


def test_recipe_data_offline_fails_naming_the_hub_dataset(monkeypatch, tmp_path):
    from hylo_bench.config import recipes as R
    from hylo_bench.upcycle.data import load_corpus

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    cfg = upcycle_config_from_recipe(R.load_recipe("HyLo-Llama-4MLA12GDN-8K-SFT"), str(tmp_path / "o"), {})
    assert cfg.data["mixture"]["sources"][0]["hub"] == "JunxiongWang/sftdatasetv3"
    check_demo_data(cfg)  # a recipe's data is not the demo text
    with pytest.raises(ValueError, match=r"hub dataset 'JunxiongWang/sftdatasetv3' .*could not be loaded.*no other "
                                         r"data is used in its place"):
        load_corpus(cfg.data)


def test_demo_data_with_a_real_base_is_refused_unless_asked_for():
    with pytest.raises(ValueError, match=r"--data demo distils --base my/model .*--allow-demo-data"):
        check_demo_data(UpcycleConfig(out="o", base="my/model"))
    check_demo_data(UpcycleConfig(out="o", base="my/model", allow_demo_data=True))
    check_demo_data(UpcycleConfig(out="o"))  # the demo teacher on its own text
    with pytest.raises(ValueError, match="--kl-tokens 'bos'"):
        validate_config(UpcycleConfig(out="o", kl_tokens="bos"))
    with pytest.raises(ValueError, match="--init-from x: the layout comes from that checkpoint"):
        validate_config(UpcycleConfig(out="o", init_from="x", layout="2MLA2GDN"))


def test_cli_refuses_demo_data_for_a_real_base_before_loading(tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app

    res = CliRunner().invoke(app, ["upcycle", "--base", "my-org/a-real-model", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--allow-demo-data" in " ".join(res.output.split())
    assert not (tmp_path / "o").exists()


def test_disabled_sources_are_never_drawn_and_columns_map_to_turns(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"problem": "1+1?", "generated_solution": "2"}) + "\n")
    (tmp_path / "b.txt").write_text("never drawn\n")
    spec = {"seed": 3, "sources": [
        {"name": "math", "path": "a.jsonl", "weight": 1.0, "prompt_field": "problem",
         "response_field": "generated_solution"},
        {"name": "off", "path": "b.txt", "weight": 5.0, "enabled": False}]}
    f = tmp_path / "mix.yaml"
    f.write_text(yaml.safe_dump(spec))
    mix = load_mixture(f)
    assert [s.name for s in mix.sources] == ["math"] and [s.name for s in mix.disabled] == ["off"]
    s = MixtureSampler(mix)
    drawn = [s.next_document() for _ in range(5)]
    assert {d[0] for d in drawn} == {0}
    assert drawn[0][2] == [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert mix.to_dict()["disabled_sources"][0]["name"] == "off"
    with pytest.raises(ValueError, match="every source is disabled"):
        parse_mixture({"sources": [{"name": "x", "path": "b.txt", "weight": 1, "enabled": False}]}, "m.yaml")
    with pytest.raises(ValueError, match="give both prompt_field and response_field"):
        parse_mixture({"sources": [{"name": "x", "path": "b.txt", "weight": 1, "prompt_field": "q"}]}, "m.yaml")
