"""Cross-field checks on a composed config, run before any process starts.

Each rule raises UserError with ONE line naming the key(s), their values and a fix. Hydra's schema has already
rejected unknown keys and wrong types; what is left are rules that span several keys or touch the machine.
"""

import os
from glob import glob

from omegaconf import DictConfig

from speedllm.config.rules import inference_layout_errors, layout_errors
from speedllm.errors import UserError
from speedllm.ops import IMPLEMENTATIONS
from speedllm.train.schedule import SCHEDULES

CHOICES = {
    "hardware.device": ("cpu", "cuda", "npu"),
    "hardware.backend": ("gloo", "nccl", "hccl"),
    "hardware.ops": IMPLEMENTATIONS,
    "hardware.dtype": ("float32", "bfloat16", "float16"),
    "parallel.pp_schedule": ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"),
    "train.recompute": ("none", "selective", "full"),
    "optim.schedule": SCHEDULES,
    "data.format": ("pretrain", "alpaca", "sharegpt", "messages"),
    "data.loss_on": ("all", "assistant", "last"),
    "data.overlong": ("truncate", "drop"),
    "data.on_error": ("fail", "skip"),
    "convert.to": ("hf", "dcp"),
    "evaluate.split": ("train", "valid", "test"),
}


def _get(cfg: DictConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_choices(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value} is not one of {', '.join(allowed)}; pick one of them")


def check_parallel(cfg: DictConfig) -> None:
    p = cfg.parallel
    errors = layout_errors(cfg.model, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, cp=p.cp, dp=p.dp,
                           schedule=p.pp_schedule, pp_layers=p.pp_layers)
    if cfg.task.inference:
        errors += inference_layout_errors(cfg.task.name, pp=p.pp, cp=p.cp, ep=p.ep)
    if errors:
        raise UserError(errors[0])


def check_task(cfg: DictConfig) -> None:
    """The task's `_target_` and the optimizer's must resolve before anything is launched."""
    from hydra.utils import get_method

    from speedllm.train.optimizer import optimizer_errors

    try:
        get_method(cfg.task._target_)
    except Exception as e:  # hydra wraps import and attribute errors alike
        raise UserError(f"task._target_={cfg.task._target_} cannot be imported ({str(e).splitlines()[0]}); "
                        "use one of the tasks in conf/task") from None
    errors = optimizer_errors(cfg.optim)
    if errors:
        raise UserError(errors[0])


def check_batch(cfg: DictConfig) -> None:
    t, p, m = cfg.train, cfg.parallel, cfg.model
    if t.global_batch_size % (t.micro_batch_size * p.dp):
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
                        f"{t.micro_batch_size} x parallel.dp={p.dp}; use a multiple of {t.micro_batch_size * p.dp}")
    if t.seq_len > m.max_position_embeddings and not cfg.task.inference:
        raise UserError(f"train.seq_len={t.seq_len} exceeds max_position_embeddings={m.max_position_embeddings} of "
                        f"model {m.name}; lower train.seq_len")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise UserError(f"train.seq_len={t.seq_len} must be divisible by 2 x parallel.cp = {2 * p.cp} "
                        f"(load-balanced causal chunks); pick a multiple of {2 * p.cp}")
    if p.tp > 1 and p.sequence_parallel and t.seq_len % p.tp:
        raise UserError(f"train.seq_len={t.seq_len} must be divisible by parallel.tp={p.tp} with sequence parallel; "
                        f"pick a multiple of {p.tp} or set parallel.sequence_parallel=false")


def check_inference(cfg: DictConfig) -> None:
    """Sampling and evaluation settings of the tasks that run a trained model."""
    gen = cfg.generate
    rules = [
        (gen.max_new_tokens >= 1, f"generate.max_new_tokens={gen.max_new_tokens} must be >= 1"),
        (gen.batch_size >= 1, f"generate.batch_size={gen.batch_size} must be >= 1"),
        (gen.temperature >= 0, f"generate.temperature={gen.temperature} must be >= 0 (0 = greedy)"),
        (gen.top_k >= 0, f"generate.top_k={gen.top_k} must be >= 0 (0 = off)"),
        (0 < gen.top_p <= 1, f"generate.top_p={gen.top_p} must be in (0, 1] (1 = off)"),
        (gen.repetition_penalty > 0, f"generate.repetition_penalty={gen.repetition_penalty} must be > 0 (1 = off)"),
        (cfg.evaluate.steps >= 1, f"evaluate.steps={cfg.evaluate.steps} must be >= 1"),
    ]
    for ok, message in rules:
        if not ok:
            raise UserError(message)


def check_world(cfg: DictConfig, world_size: int) -> None:
    p = cfg.parallel
    product = p.dp * p.cp * p.tp * p.pp
    if product != world_size:
        raise UserError(f"parallel dp={p.dp} x cp={p.cp} x tp={p.tp} x pp={p.pp} = {product} does not match the world "
                        f"size {world_size} (launcher.nnodes={cfg.launcher.nnodes} x launcher.nproc_per_node="
                        f"{cfg.launcher.nproc_per_node}); set parallel.dp=-1 to infer it or fix the launcher counts")


def check_device(cfg: DictConfig, nproc_per_node: int) -> None:
    """The hardware profile's device must be here (not for planning, which targets machines the user lacks)."""
    import torch

    hw = cfg.hardware
    if hw.device == "cpu":
        return
    if hw.device == "cuda":
        found = torch.cuda.device_count()
    else:
        from speedllm.hardware import npu_available

        found = torch.npu.device_count() if npu_available() else 0
    if found < nproc_per_node:
        raise UserError(f"hardware={hw.name} needs {nproc_per_node} {hw.device} device(s) per node but {found} "
                        f"found here; use hardware=cpu (or hardware=auto), or lower launcher.nproc_per_node")


def _must_exist(key: str, path: str, fix: str) -> None:
    if not (os.path.exists(path) or glob(path)):
        raise UserError(f"{key}={path} does not exist; {fix}")


def check_paths(cfg: DictConfig) -> None:
    ck, d, task = cfg.checkpoint, cfg.data, cfg.task.name
    if ck.load not in (None, "auto"):
        _must_exist("checkpoint.load", ck.load, "point it at a checkpoint directory (or use checkpoint.load=auto)")
    if ck.load_hf is not None:
        _must_exist("checkpoint.load_hf", ck.load_hf, "point it at a Hugging Face model directory")
    if task != "doctor":
        _must_exist("data.tokenizer", d.tokenizer, "point it at a Hugging Face tokenizer directory")
    if task == "preprocess":
        if d.input is None or d.output_prefix is None:
            raise UserError("task=preprocess needs data.input=<file or glob> and data.output_prefix=<prefix>")
        for item in [d.input] if isinstance(d.input, str) else d.input:
            _must_exist("data.input", item, "give a file, a glob or a list of them")
    if d.path is not None and task in ("pretrain", "evaluate"):
        items = [d.path] if isinstance(d.path, str) else list(d.path)
        for prefix in items[1::2] if len(items) > 1 else items:
            for suffix in (".bin", ".idx"):
                _must_exist("data.path", f"{prefix}{suffix}", "give the prefix of a .bin/.idx pair "
                            "(e.g. made by task=preprocess)")
    if task == "generate" and cfg.generate.prompt is None and cfg.generate.prompts_file is None:
        raise UserError("task=generate needs generate.prompt=<text> or generate.prompts_file=<path>")
    if cfg.generate.prompts_file is not None and task == "generate":
        _must_exist("generate.prompts_file", cfg.generate.prompts_file, "one prompt per line, or jsonl")
    if task == "convert":
        if cfg.convert.out is None:
            raise UserError("task=convert needs convert.out=<output directory>")
        source = ck.load_hf if cfg.convert.to == "dcp" else ck.load
        if source is None:
            need = "checkpoint.load_hf=<HF dir>" if cfg.convert.to == "dcp" else "checkpoint.load=<checkpoint dir>"
            raise UserError(f"task=convert convert.to={cfg.convert.to} needs {need}")


def check_tokenizer(cfg: DictConfig) -> None:
    from speedllm.data.tokenizer import tokenizer_vocab_size

    size = tokenizer_vocab_size(cfg.data.tokenizer)
    if size > cfg.model.vocab_size:
        raise UserError(f"data.tokenizer={cfg.data.tokenizer} has {size} tokens but model {cfg.model.name} has "
                        f"vocab_size={cfg.model.vocab_size}; use the model's tokenizer or a model with a larger vocab")


def check_hf_model(cfg: DictConfig) -> None:
    """model=hf needs checkpoint.load_hf; any other model= must agree with the config.json it loads.

    Runs first: model=hf's fields are read from that config.json when anything looks at them.
    """
    from speedllm.checkpoint.hf import config_mismatches, read_hf_config

    load_hf, name = cfg.checkpoint.load_hf, cfg.model.name
    if name == "hf" and load_hf is None:
        raise UserError("model=hf takes the model from checkpoint.load_hf's config.json; set "
                        "checkpoint.load_hf=<HF model dir>")
    if load_hf is None:
        return
    _must_exist("checkpoint.load_hf", load_hf, "point it at a Hugging Face model directory")
    read_hf_config(load_hf)
    # task=convert takes the model from its source, whatever model= says
    mismatches = [] if name == "hf" or cfg.task.name == "convert" else config_mismatches(cfg.model, load_hf)
    if mismatches:
        raise UserError(f"checkpoint.load_hf={load_hf}: config.json disagrees with model={name} on "
                        f"{', '.join(mismatches)} (config.json vs model); use model=hf to take the model from "
                        "config.json, or the matching model=")


def validate(cfg: DictConfig, world_size: int, nproc_per_node: int) -> None:
    """Run every rule; the first failure raises UserError."""
    check_hf_model(cfg)
    check_choices(cfg)
    check_task(cfg)
    check_parallel(cfg)
    check_batch(cfg)
    if cfg.task.inference:
        check_inference(cfg)
    if cfg.task.name != "plan":
        check_world(cfg, world_size)
        check_paths(cfg)
        if not cfg.task.in_process:
            check_device(cfg, nproc_per_node)
        if cfg.task.name not in ("doctor", "convert", "preprocess"):  # preprocess uses no model
            check_tokenizer(cfg)
