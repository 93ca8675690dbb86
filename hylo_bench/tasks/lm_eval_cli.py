"""lm-eval's own command line with the ``hylo`` model registered.

lm-eval 0.4.13 finds models only in its registry and its built-in ``MODEL_MAPPING``; it scans no entry points, so
``lm_eval --model hylo`` cannot see an installed plugin. This launcher imports the bridge first:
``hylo-lm-eval run --model hylo --model_args pretrained=demo --tasks piqa --num_fewshot 0`` (also
``python -m hylo_bench.tasks.lm_eval_cli ...``).
"""

from __future__ import annotations


def main() -> None:
    """Register ``hylo`` and hand over to ``lm_eval.__main__.cli_evaluate`` (same arguments as ``lm_eval``)."""
    from lm_eval.__main__ import cli_evaluate

    import hylo_bench.tasks.lm_eval_bridge  # noqa: F401 - registers the model

    cli_evaluate()


if __name__ == "__main__":
    main()
