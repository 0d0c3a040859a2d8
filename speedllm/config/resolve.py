"""Resolution: fill in what the user left to us, before the one pre-flight check (speedllm.config.validate).

    file:// URLs, URL credentials -> plain paths; credentials masked (speedllm.config.locations)
    remote model and data inputs -> local copies in data.cache_dir (checkpoint.load_hf, distill.teacher, data.input)
    hardware=auto        -> the profile of the devices this machine has (the hardware.* values typed kept)
    hardware.dtype=auto  -> on a CPU, what its GEMM probe shows faster; the CPU's peaks measured (speedllm.hardware)
    hardware.batch_invariant unset -> on for a task that scores its own samples (grpo, on-policy distill) on a CPU
                            in bfloat16, else off
    model=hf             -> the fields of checkpoint.load_hf's config.json, as values
    checkpoint.load      -> the model and tokenizer the checkpoint was trained with (inference tasks; a training
                            run too when that checkpoint's run started from another task's weights)
    launcher.nnodes > 1  -> the node rank and rendezvous host from SLURM
    parallel=auto        -> the planner's fastest layout that fits; parallel.dp=-1 and the rank counts from the world
"""

import importlib.util
import os

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from speedllm import storage
from speedllm.checkpoint.dcp import read_saved_config, resolve_load, started_from
from speedllm.config.locations import mend_locations
from speedllm.config.validate import validate_values
from speedllm.errors import UserError
from speedllm.hardware import detect, load_profile, resolve_dtype
from speedllm.parallel.rules import V_SCHEDULES
from speedllm.runtime import under_torchrun
from speedllm.tasks import task_spec


def resolve(cfg: DictConfig) -> tuple[int, int]:
    """Resolve cfg in place (see the module docstring); returns (world_size, nproc_per_node)."""
    mend_locations(cfg)
    resolve_hardware(cfg)
    fetch_inputs(cfg)
    resolve_model(cfg)
    validate_values(cfg)  # values first: a typo is named before a missing checkpoint, and the layout is derived
    resolve_batch_invariant(cfg)
    another = None if cfg.task.inference else another_tasks_checkpoint(cfg)
    if cfg.task.inference or another is not None:  # from sane launcher counts and planner sizes
        adopt_checkpoint_config(cfg, another)
    if not cfg.task.in_process:  # a job that is not launched needs no rendezvous
        resolve_nodes(cfg)
    return resolve_layout(cfg)


def fetch_inputs(cfg: DictConfig) -> None:
    """Model directories (checkpoint.load_hf, distill.teacher: a Hugging Face directory) and the record files of
    sft, dpo and grpo (data.input) given as URLs: their files copied once into data.cache_dir (per version), and the
    key set to that copy, so everything after reads local files."""
    task = cfg.task.name
    for key in ("checkpoint.load_hf", "distill.teacher"):
        url = OmegaConf.select(cfg, key)
        if url is not None and storage.is_url(url) and (key != "distill.teacher" or task == "distill"):
            storage.check(key, url, must_exist=True)
            OmegaConf.update(cfg, key, str(storage.cached_dir(url, cfg.data.cache_dir)))
    d = cfg.data
    patterns = [] if d.input is None else [d.input] if isinstance(d.input, str) else list(d.input)
    if task in ("sft", "dpo", "grpo") and any(storage.is_url(p) for p in patterns):
        for p in patterns:
            if storage.is_url(p):
                storage.check("data.input", p, must_exist=True)
        d.input = storage.local_inputs(patterns, d.cache_dir)


def resolve_model(cfg: DictConfig) -> None:
    """The model's fields as values: model=hf reads them from config.json through `${hf_model:...}`, and a
    rope_scaling dict (YaRN, linear, dynamic) cannot stay an interpolation when the config is frozen."""
    if OmegaConf.is_interpolation(cfg.model, "rope_scaling"):
        cfg.model.rope_scaling = OmegaConf.select(cfg.model, "rope_scaling")


def resolve_hardware(cfg: DictConfig) -> None:
    """hardware=auto becomes the detected profile, with the hardware.* values the user typed on top (an explicit
    hardware.dtype wins whatever the profile says); then its dtype and a CPU's peaks (speedllm.hardware)."""
    if cfg.hardware.name == "auto":
        typed = {key: cfg.hardware[key] for key in typed_hardware_keys(cfg)}
        cfg.hardware = OmegaConf.merge(load_profile(detect()), typed)
    resolve_dtype(cfg.hardware)


def resolve_batch_invariant(cfg: DictConfig) -> None:
    """hardware.batch_invariant left unset: on where the task asks for it (TaskSpec.batch_invariant) on a CPU in
    bfloat16, else off. After validate_values, which names a mistyped task before its spec is looked up."""
    hw = cfg.hardware
    if hw.batch_invariant is None:
        hw.batch_invariant = hw.device == "cpu" and hw.dtype == "bfloat16" and \
            task_spec(cfg.task.name).batch_invariant(cfg)


def typed_hardware_keys(cfg: DictConfig) -> list:
    """The hardware.<key>s set on the command line (Hydra's overrides), or where the config was composed
    without Hydra's app (speedllm.config.compose_config), those differing from the hardware=auto profile."""
    if HydraConfig.initialized():
        overrides = (o.lstrip("+~").partition("=")[0] for o in HydraConfig.get().overrides.task)
        return sorted({o.split(".")[1] for o in overrides if o.startswith("hardware.")} - {"name"})
    auto = load_profile("auto")
    return [key for key in auto if key != "name" and cfg.hardware[key] != auto[key]]


def resolve_nodes(cfg: DictConfig) -> None:
    """Multi-node: under SLURM (Hydra's submitit launcher, one task per node) take the node rank and rendezvous
    host from the job; elsewhere the user names the rendezvous endpoint (node 0's host:port)."""
    lc = cfg.launcher
    if lc.nnodes == 1 or under_torchrun():
        return
    if "SLURM_JOB_ID" in os.environ and importlib.util.find_spec("submitit") is not None:
        import submitit

        job = submitit.JobEnvironment()
        lc.node_rank = job.node
        if lc.rdzv_endpoint.startswith("localhost"):
            lc.rdzv_endpoint = f"{job.hostnames[0]}:29500"
    if lc.rdzv_endpoint.startswith("localhost") or lc.rdzv_endpoint.endswith(":0"):
        raise UserError(f"launcher.nnodes={lc.nnodes} needs launcher.rdzv_endpoint=<host of node 0>:<free port> "
                        f"(now {lc.rdzv_endpoint}), the same on every node")


def resolve_layout(cfg: DictConfig) -> tuple[int, int]:
    """Fill in parallel.dp (when -1) and launcher.nproc_per_node (when 0); return (world_size, nproc_per_node).

    Under torchrun the world comes from its environment; otherwise from the launcher counts, or, when
    those are left at 0, from the parallel layout itself (so `parallel=tp8` alone means 8 ranks).
    """
    p, launcher = cfg.parallel, cfg.launcher
    if p.name == "auto":
        choose_layout(cfg)
    if p.pp_schedule in V_SCHEDULES and p.pp > 1 and p.vpp == 1:
        p.vpp = 2  # a V schedule places two stages per pipeline rank: the only vpp it runs
    if p.pp_schedule == "DualPipeV" and p.pp > 1:
        print("parallel.pp_schedule=DualPipeV: torch's ScheduleDualPipeV without an overlap function runs each paired "
              "forward and backward one after the other (no compute/communication overlap); costed so by task=plan")
    model_parallel = p.tp * p.pp * p.cp
    if under_torchrun():
        world, nproc = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    elif launcher.nproc_per_node > 0:
        nproc = launcher.nproc_per_node
        world = launcher.nnodes * nproc
    else:
        world = max(p.dp, 1) * model_parallel
        if world % launcher.nnodes:
            raise UserError(f"the layout needs {world} ranks, which launcher.nnodes={launcher.nnodes} does not divide; "
                            f"set launcher.nproc_per_node explicitly")
        nproc = world // launcher.nnodes
    if p.dp == -1:
        if world % model_parallel:
            raise UserError(f"world size {world} is not divisible by tp x pp x cp = {model_parallel}; "
                            f"fix launcher.nproc_per_node / launcher.nnodes or the parallel degrees")
        p.dp = world // model_parallel
    launcher.nproc_per_node = nproc
    return world, nproc


def choose_layout(cfg: DictConfig) -> None:
    """parallel=auto: fill cfg.parallel (and train.micro_batch_size / train.recompute / train.activation_offload
    when training) in place with the fastest layout that fits on the devices the launcher names (with offload only
    when nothing fits without: speedllm.planner.search.Planner.search)."""
    from speedllm.planner import device_count
    from speedllm.planner.layout import apply_layout, uneven
    from speedllm.planner.memory import GIB
    from speedllm.planner.search import Planner, problem_from_config
    from speedllm.tasks import planned_spec

    world = device_count(cfg)
    spec = planned_spec(cfg)
    planner = Planner(problem_from_config(cfg, world, spec))
    train = not spec.inference
    result = planner.search() if train else None
    best = result.best if train else planner.inference_layout()
    where = f"model {cfg.model.name} on {world} x {cfg.hardware.name}"
    if train and not result.fitting and not result.too_big and result.invalid:  # the task's rules refuse them all
        reasons = sorted(result.invalid, key=result.invalid.get, reverse=True)[:3]
        raise UserError(f"parallel=auto: no layout of {where} passes the rules of task={cfg.task.name} ("
                        f"{'; '.join(reasons)}); change the settings they name or the device count")
    if best is None:
        raise UserError(f"parallel=auto: no layout of {where} fits (memory_gb={cfg.hardware.memory_gb}); add devices "
                        f"(launcher.nnodes / launcher.nproc_per_node) or lower {spec.workload_keys}"
                        + ("" if cfg.plan.allow_offload or not train else ", or allow offload (plan.allow_offload=true)"))
    lay = best.layout
    apply_layout(lay, cfg.parallel, None if not train else cfg.train, uneven(planner.split(lay)))
    if cfg.launcher.nproc_per_node == 0:
        cfg.launcher.nproc_per_node = world // cfg.launcher.nnodes
    if train:
        print(f"parallel=auto: {lay.short()} on {world} device(s): {best.memory.total / GIB:.1f} GiB per device, "
              f"~{best.tokens_per_s:,.0f} tokens/s (task=plan shows the alternatives)")
    else:
        print(f"parallel=auto: {lay.short()} on {world} device(s): {best.memory.total / GIB:.1f} GiB per device")


def another_tasks_checkpoint(cfg: DictConfig):
    """The checkpoint a launched job's checkpoint.load names (resolved), when its run started from another task's
    weights (that checkpoint itself, or one it resumes): the job takes that run's model and tokenizer, as an
    inference task does. Else None."""
    ck = cfg.checkpoint
    if cfg.task.in_process or ck.load_hf is not None or ck.load is None:
        return None
    if storage.is_url(ck.load):  # a server that does not answer fails here in seconds, not at resolve_load's pace
        storage.check("checkpoint.load", ck.load, must_exist=True)
    try:
        path = resolve_load(ck.load, ck.dir)
    except UserError:  # no checkpoint there: validation names the key and the fix
        return None
    return path if path is not None and started_from(path, cfg.task.name) is not None else None


def adopt_checkpoint_config(cfg: DictConfig, path=None) -> bool:
    """With checkpoint.load, the architecture and tokenizer the checkpoint was trained with replace cfg's;
    returns whether they did.

    Before validation and freezing, so <run_dir>/config.yaml is the model that runs and is checked as such.
    (An HF directory needs nothing here: model=hf reads its config.json, and validation checks any other
    model= against it.) `path`: checkpoint.load already resolved.
    """
    ck = cfg.checkpoint
    if ck.load_hf is not None or ck.load is None:  # no weights at all: validation says what to give
        return False
    path = path if path is not None else resolve_load(ck.load, ck.dir)
    if path is None:
        raise UserError(f"checkpoint.load={ck.load}: no checkpoint there yet; point it at a step_* directory or a "
                        "checkpoints directory")
    frozen = storage.join(path, "config.yaml")
    with open_dict(cfg):
        ck.load = str(path)
        if not storage.is_file(frozen):
            return False
        saved = read_saved_config(path)
        if saved.model != cfg.model:
            print(f"model and tokenizer from {frozen}: {saved.model.name}")
        cfg.model = OmegaConf.merge(cfg.model, saved.model)
        cfg.data.tokenizer = saved.data.tokenizer
        if OmegaConf.select(saved, "finetune.name", default="full") != "full":  # an adapter run: its adapters
            cfg.finetune = OmegaConf.merge(cfg.finetune, saved.finetune)
    return True
