"""The planner and validation share one rule set: `parallel=auto` builds exactly the layout the planner ranked
first, and every layout `task=plan` ranks passes validation when set explicitly (speedllm.parallel.rules)."""

import pytest
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.config.resolve import choose_layout
from speedllm.planner.layout import layout_from_config, uneven
from speedllm.planner.search import Planner, problem_from_config

pytestmark = pytest.mark.unit


def auto(*overrides):
    """The config `parallel=auto <overrides>` resolves to (in process: choose_layout), and the planner's ranking."""
    cfg = compose_config("parallel=auto", *overrides)
    OmegaConf.set_struct(cfg, False)
    planner = Planner(problem_from_config(cfg, cfg.launcher.nnodes * cfg.launcher.nproc_per_node))
    result = planner.search()
    choose_layout(cfg)
    return cfg, planner, result


def test_parallel_auto_builds_the_layout_it_announces_cp_mode_included(capsys):
    cfg, planner, result = auto("task=dryrun", "model=qwen3_8b", "hardware=h100", "launcher.nproc_per_node=8",
                                "train.seq_len=32768")
    first = result.best.layout
    announced = capsys.readouterr().out
    assert f"parallel=auto: {first.short()} on 8 device(s)" in announced
    assert first.cp > 1 and first.cp_mode != "allgather"  # the case that was built as allgather
    assert layout_from_config(cfg.parallel, cfg.train) == first
    assert cfg.parallel.pp_layers == uneven(planner.split(first))
