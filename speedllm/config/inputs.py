"""What a run reads: optional packages (extras), paths, a Hugging Face config.json, an inference task's weights
and prompts (a task's own files, such as GRPO's rewards and prompts or distill's teacher: its SPEC's inputs).
"""

import importlib.util
import os
from glob import glob

from omegaconf import DictConfig

from speedllm.errors import UserError
from speedllm.tasks import task_spec


# (what needs it, module, extra): a choice that imports an optional package, checked before anything runs
def _extras(cfg: DictConfig):
    if cfg.quant.name != "none":
        yield f"quant={cfg.quant.name}", "torchao", "quant"
    if cfg.finetune.name == "qlora":
        yield "finetune=qlora", "torchao", "finetune"
    yield from task_spec(cfg.task.name).extras(cfg)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def check_extras(cfg: DictConfig) -> None:
    for what, module, extra in _extras(cfg):
        if not _installed(module):
            raise UserError(f"{what} needs {module}, which is not installed: pip install 'speedllm[{extra}]' "
                            f"(from a checkout: pip install -e '.[{extra}]')")


def _must_exist(key: str, path: str, fix: str) -> None:
    from speedllm import storage

    if storage.is_url(path):
        return storage.check(key, path, must_exist=True)
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
    if d.path is not None and task in ("pretrain", "distill", "evaluate"):
        items = [d.path] if isinstance(d.path, str) else list(d.path)
        for prefix in items[1::2] if len(items) > 1 else items:
            for suffix in (".bin", ".idx"):
                _must_exist("data.path", f"{prefix}{suffix}", "give the prefix of a .bin/.idx pair "
                            "(e.g. made by task=preprocess)")
    if cfg.generate.prompts_file is not None and task == "generate":
        _must_exist("generate.prompts_file", cfg.generate.prompts_file, "one prompt per line, or jsonl")
    if task == "convert":
        if cfg.convert.out is None:
            raise UserError("task=convert needs convert.out=<output directory>")
        source = ck.load_hf if cfg.convert.to == "dcp" else ck.load
        if source is None:
            need = "checkpoint.load_hf=<HF dir>" if cfg.convert.to == "dcp" else "checkpoint.load=<checkpoint dir>"
            raise UserError(f"task=convert convert.to={cfg.convert.to} needs {need}")


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


def check_inputs(cfg: DictConfig) -> None:
    """What an inference task reads: weights, and for task=generate prompts (checked after every value rule)."""
    gen = cfg.generate
    if cfg.task.name == "generate" and gen.prompt is None and gen.prompts_file is None:
        raise UserError("task=generate needs generate.prompt=<text> or generate.prompts_file=<path>")
    if cfg.checkpoint.load is None and cfg.checkpoint.load_hf is None:
        raise UserError(f"task={cfg.task.name} needs weights: checkpoint.load=<checkpoint dir> (from a training "
                        "run) or checkpoint.load_hf=<Hugging Face model dir> (with model=hf)")
