"""Auto-parallel planner: per-rank memory and step-time model, layout search, `parallel=auto`, `task=plan`."""

from omegaconf import DictConfig

from speedllm.errors import UserError


def choose_layout(cfg: DictConfig) -> None:
    """parallel=auto: fill cfg.parallel (and train.micro_batch_size / train.recompute / train.activation_offload
    when training) in place with the fastest layout that fits on the devices the launcher names (with offload only
    when nothing fits without: speedllm.planner.search.Planner.search)."""
    from speedllm.planner.memory import GIB
    from speedllm.planner.plan import device_count
    from speedllm.planner.search import Planner, problem_from_config

    world = device_count(cfg)
    planner = Planner(problem_from_config(cfg, world))
    train = not cfg.task.inference
    best = planner.search().best if train else planner.inference_layout(cfg.generate.batch_size,
                                                                         cfg.generate.max_new_tokens)
    if best is None:
        raise UserError(f"parallel=auto: no layout of model {cfg.model.name} fits on {world} x {cfg.hardware.name} "
                        f"(memory_gb={cfg.hardware.memory_gb}); add devices (launcher.nnodes / "
                        f"launcher.nproc_per_node) or lower train.seq_len, train.global_batch_size"
                        + ("" if cfg.plan.allow_offload or not train else ", or allow offload (plan.allow_offload=true)"))
    lay, p = best.layout, cfg.parallel
    p.dp, p.tp, p.pp, p.vpp, p.ep, p.cp = lay.dp, lay.tp, lay.pp, lay.vpp, lay.ep, lay.cp
    p.fsdp, p.pp_schedule, p.offload = lay.fsdp, lay.schedule, lay.offload
    split = planner.split(lay)
    p.pp_layers = split if lay.pp > 1 and len(set(split)) > 1 else None
    if cfg.launcher.nproc_per_node == 0:
        cfg.launcher.nproc_per_node = world // cfg.launcher.nnodes
    if train:
        cfg.train.micro_batch_size, cfg.train.recompute = lay.micro_batch, lay.recompute
        cfg.train.activation_offload = lay.activation_offload
        print(f"parallel=auto: {lay.short()} on {world} device(s): {best.memory.total / GIB:.1f} GiB per device, "
              f"~{best.tokens_per_s:,.0f} tokens/s (task=plan shows the alternatives)")
    else:
        print(f"parallel=auto: {lay.short()} on {world} device(s): {best.memory.total / GIB:.1f} GiB per device")
