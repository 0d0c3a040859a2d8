"""The tasks a run can be (`task=<name>`): each module's `run(cfg, rt)` is a conf/task/*.yaml `_target_`, and its
`SPEC` (speedllm.planner.spec.TaskSpec) what validation, the planner and the dry run need to know of it.

Tasks compose the layers below (generation, train, planner, parallel, checkpoint, ...); they never import each other.
"""

import importlib
from functools import lru_cache

from omegaconf import OmegaConf

from speedllm.paths import CONF
from speedllm.planner.spec import TRAINING, TaskSpec


@lru_cache(maxsize=None)  # the conf/task files and modules of one process do not change
def task_spec(name: str) -> TaskSpec:
    """What task=<name> declares: the SPEC of the module its conf/task file runs (TRAINING where it has none)."""
    target = OmegaConf.load(CONF / "task" / f"{name}.yaml").task._target_
    return getattr(importlib.import_module(target.rsplit(".", 1)[0]), "SPEC", TRAINING)


def planned_spec(cfg) -> TaskSpec:
    """The declarations planning reads for this run: its task's, or those of the task it plans for (plan.task)."""
    spec = task_spec(cfg.task.name)
    return spec if spec.plans is None else task_spec(spec.plans(cfg))
