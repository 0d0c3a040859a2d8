"""The tasks a run can be (`task=<name>`): each module's `run(cfg, rt)` is a conf/task/*.yaml `_target_`.

Tasks compose the layers below (generation, train, planner, parallel, checkpoint, ...); they never import each other.
"""
