"""Where a run reads and writes, checked before launch: file:// URLs as the plain paths they name, credentials in
URLs masked (speedllm.storage), and no output on top of an input.

Outputs: checkpoint.dir, convert.out, data.output_prefix, generate.output and the run directory. Inputs:
checkpoint.load (its `latest` followed), checkpoint.load_hf, distill.teacher, finetune.adapter, data.tokenizer,
data.path, data.input, generate.prompts_file. Paths are compared after links are resolved.
"""

import os
from glob import glob

from omegaconf import DictConfig, ListConfig, OmegaConf

from speedllm import storage
from speedllm.errors import UserError

PATH_KEYS = ("checkpoint.dir", "checkpoint.load", "checkpoint.load_hf", "convert.out", "data.input", "data.path",
             "data.output_prefix", "data.tokenizer", "data.cache_dir", "generate.output", "generate.prompts_file",
             "distill.teacher", "finetune.adapter", "evaluate.include_path")
TRAINING = ("pretrain", "sft", "dpo", "grpo", "distill")
RUN_FILES = ("config.yaml", "launch.log", "metrics.jsonl", "tensorboard", ".hydra")  # what a run dir holds


def file_path(key: str, value):
    """A `file://` URL as the plain path it names (`file:///abs` and `file://localhost/abs`); `file:` with one
    slash and a relative `file://` are refused (the first would name a folder called `file:`)."""
    if not isinstance(value, str) or not value.startswith("file:"):
        return value
    rest = value[len("file:"):]
    if not rest.startswith("//"):
        raise UserError(f"{key}={value}: a file URL has two slashes before the path (file:///absolute/path); give "
                        f"{key}=file://{rest} or the plain path {rest}")
    rest = rest[2:]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    if not rest.startswith("/"):
        raise UserError(f"{key}={value}: file:// needs an absolute path (file:///absolute/path; what follows file:// "
                        f"is a host); give {key}=file:///<absolute path> or a plain relative path {rest}")
    return rest


def _mended(node, key: str) -> None:
    """Each string of `node` (a config, or a list of one) with its URL credentials masked, and, under PATH_KEYS,
    its file:// URL made a path."""
    for name in list(node.keys()) if isinstance(node, DictConfig) else range(len(node)):
        child = node._get_node(name)
        dotted = f"{key}.{name}" if key and isinstance(node, DictConfig) else key or str(name)
        if child is None or child._is_interpolation() or child._is_missing():
            continue
        if isinstance(child, (DictConfig, ListConfig)):
            if not child._is_none():
                _mended(child, dotted)
            continue
        value = child._value()
        if isinstance(value, str):
            mended = storage.hide_credentials(value) if "@" in value else value
            mended = file_path(dotted, mended) if dotted in PATH_KEYS else mended
            if mended != value:
                node[name] = mended


def mend_locations(cfg: DictConfig) -> None:
    """In place, before anything reads the config: file:// URLs made paths, credentials moved out of URLs (into
    the environment of this process and its ranks: speedllm.storage.hide_credentials)."""
    _mended(cfg, "")


def _real(path) -> str:
    if storage.is_url(path):  # without its credentials, masked or not
        return storage.shown(path).replace(f"{storage.MASK}@", "").rstrip("/")
    return os.path.realpath(os.path.expanduser(str(path)))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/" + os.sep) + ("/" if "://" in folder else os.sep))


def _inputs(cfg: DictConfig) -> dict:
    """key -> the paths each input key reads (checkpoint.load and a checkpoint teacher: the step they resolve to)."""
    from speedllm.checkpoint.dcp import resolve_load

    ck, d, task = cfg.checkpoint, cfg.data, cfg.task.name
    inputs = {"data.tokenizer": [d.tokenizer]}
    if ck.load is not None:
        step = resolve_load(ck.load, ck.dir)
        if step is not None:
            inputs["checkpoint.load"] = [step] + ([] if ck.load == "auto" else [ck.load])
    for key in ("checkpoint.load_hf", "distill.teacher", "finetune.adapter", "generate.prompts_file"):
        value = OmegaConf.select(cfg, key)
        if value is not None and (key != "distill.teacher" or task == "distill"):
            inputs[key] = [value]
    teacher = inputs.get("distill.teacher", [None])[0]
    if teacher is not None and storage.exists(storage.join(teacher, "latest")):  # a checkpoint root: its step
        inputs["distill.teacher"].append(resolve_load(teacher, ""))
    if d.input is not None:
        patterns = [d.input] if isinstance(d.input, str) else list(d.input)
        inputs["data.input"] = [f for p in patterns for f in ([] if storage.is_url(p) else glob(str(p), recursive=True))
                                or [p]]
    if d.path is not None and task in ("pretrain", "distill", "evaluate"):
        items = [d.path] if isinstance(d.path, str) else list(d.path)
        inputs["data.path"] = [f"{p}{s}" for p in (items[1::2] if len(items) > 1 else items) for s in (".bin", ".idx")]
    return inputs


def check_no_overlap(outputs: dict, inputs: dict, run_dir: str) -> None:
    """Refuse (one line naming both keys) an output that is an input or holds one, or (but checkpoint.dir, whose
    steps and pruning reach only what lies under it) lies inside one; the run directory where it is an input or one
    of its files is. A resume reads checkpoint.load from checkpoint.dir: that pair is allowed."""
    outputs = {**outputs, "hydra.run.dir (the run directory)": [run_dir]}
    for out_key, out_paths in outputs.items():
        for out_path in out_paths:
            dst = _real(out_path)
            for in_key, in_paths in inputs.items():
                if out_key == "checkpoint.dir" and in_key == "checkpoint.load":
                    continue  # a resume: new steps beside the one it loads
                for in_path in in_paths:
                    src = _real(in_path)
                    if out_key.startswith("hydra"):
                        clash = src == dst or any(_inside(src, os.path.join(dst, f)) for f in RUN_FILES)
                    elif out_key == "checkpoint.dir":  # its steps, `latest` and pruning: what lies under it
                        clash = _inside(src, dst)
                    else:
                        clash = _inside(src, dst) or _inside(dst, src)
                    if clash:
                        raise UserError(f"{out_key}={storage.shown(out_path)} would write over the input {in_key}="
                                        f"{storage.shown(in_path)}; choose another {out_key} so the input is kept")


def check_outputs(cfg: DictConfig) -> None:
    """No output may write over an input, and each output can be written (a probe file in checkpoint.dir):
    refused before any work."""
    from speedllm.outputs import check_writable

    task, d, ck, gen = cfg.task.name, cfg.data, cfg.checkpoint, cfg.generate
    for key, path in (("data.output_prefix", d.output_prefix), ("generate.output", gen.output)):
        if path is not None and str(path).endswith(("/", os.sep)):
            raise UserError(f"{key}={path} ends in '/', a folder; {key} names a file, e.g. {key}={path}"
                            f"{'corpus' if key == 'data.output_prefix' else 'out.jsonl'}")
    outputs = {}
    if task in TRAINING:  # every training run saves (at the end, or when stopped early)
        check_writable("checkpoint.dir", ck.dir, directory=True, probe=True)
        outputs["checkpoint.dir"] = [ck.dir]
    if task == "preprocess":
        outputs["data.output_prefix"] = [f"{d.output_prefix}{suffix}" for suffix in (".bin", ".idx", ".json")]
        check_writable("data.output_prefix", f"{d.output_prefix}.bin")
    elif task == "generate" and gen.output is not None:
        outputs["generate.output"] = [gen.output]
        check_writable("generate.output", gen.output)
    elif task == "convert":
        outputs["convert.out"] = [cfg.convert.out]
        check_writable("convert.out", cfg.convert.out, directory=True)
    check_no_overlap(outputs, _inputs(cfg), cfg.run_dir)
