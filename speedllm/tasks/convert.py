"""task=convert: an HF directory to a DCP checkpoint, and any of our checkpoints back to an HF directory.

    python launch.py task=convert checkpoint.load_hf=<HF dir> convert.to=dcp convert.out=<dir>
    python launch.py task=convert checkpoint.load=<checkpoint dir> convert.to=hf convert.out=<dir> [quant=int8_wo]
    python launch.py task=convert checkpoint.load=<LoRA run checkpoints> convert.to=peft convert.out=<dir>

Both run in one process on the CPU. Our checkpoints are layout-free, so a checkpoint saved under any parallel
layout converts the same way. The DCP checkpoint written here is laid out like a training checkpoint
(<out>/step_00000000 + `latest`) and holds the model only (no optimizer state), plus a release's tensors beside
the text model (vision tower, MTP head) as safetensors in hf_extras/; the HF directory's config.json,
generation_config.json, tokenizer files and tensor naming are kept under step_00000000/hf/ so that the way back
reproduces them exactly.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf

from speedllm import storage
from speedllm.checkpoint.adapters import export_merged, export_peft, holds_adapters
from speedllm.checkpoint.dcp import (
    LATEST,
    _quiet_dcp,
    dcp_load,
    read_metadata,
    read_saved_config,
    resolve_load,
    step_dir_name,
)
from speedllm.checkpoint.hf import (
    EXTRAS_DIR,
    RELEASE_DIR,
    check_hf_files,
    has_tokenizer,
    has_weights,
    hf_model_fields,
    read_extras,
    read_hf_config,
    weight_files,
    write_release,
    write_hf_dir,
)
from speedllm.errors import UserError
from speedllm.hardware import DTYPES
from speedllm.models.hf_adapter import from_hf_state_dict, is_extra
from speedllm.outputs import make_scratch_dir
from speedllm.storage import write_text_atomic

EXTRAS = "hf_extras"  # DCP key of a release's extras in checkpoints converted before they moved to hf_extras/


def _dtype(cfg: DictConfig):
    if cfg.convert.dtype is None:
        return None
    if cfg.convert.dtype not in DTYPES:
        raise UserError(f"convert.dtype={cfg.convert.dtype} is not one of {', '.join(DTYPES)}; pick one of them "
                        "or leave it unset to keep the checkpoint's dtype")
    return DTYPES[cfg.convert.dtype]


def hf_to_dcp(path: str, out: str, cfg: DictConfig) -> Path:
    """Convert the HF directory `path` into a model-only DCP checkpoint under `out`; return its step directory."""
    from safetensors import safe_open
    from tqdm import tqdm

    from speedllm.models.config import ModelConfig
    from speedllm.paths import ASSETS

    out_root = Path(out)
    if out_root.exists() and any(out_root.iterdir()):
        raise UserError(f"convert.out={out} exists and is not empty; choose a new directory or remove it")
    read_hf_config(path)
    final = out_root / step_dir_name(0)
    # without tokenizer files of its own, a Qwen3 checkpoint goes with the bundled Qwen3 tokenizer
    tokenizer = str(final / RELEASE_DIR) if has_tokenizer(path) else str(ASSETS / "tokenizers" / "qwen3")
    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                {"name": Path(path).resolve().name, "tokenizer": tokenizer, **hf_model_fields(path)})
    files = weight_files(path)
    check_hf_files(path, model_cfg, files)

    text = {name: file for name, file in files.items() if not is_extra(name)}  # the extras: write_release below
    hf_state = {}
    for file in tqdm(sorted(set(text.values())), desc="reading safetensors", unit="file",
                     disable=not cfg.logging.progress_bar):
        with safe_open(str(file), framework="pt") as reader:
            hf_state.update({name: reader.get_tensor(name) for name in reader.keys() if name in text})
    state = from_hf_state_dict(hf_state, model_cfg)
    dtype = _dtype(cfg)
    if dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}

    tmp = make_scratch_dir(out_root / f".{final.name}.tmp", "convert.out")
    with _quiet_dcp():
        dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
    write_release(path, tmp)
    saved = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)  # typed objects or DictConfig
    saved["model"] = OmegaConf.to_container(model_cfg, resolve=True)
    saved["data"]["tokenizer"] = tokenizer
    OmegaConf.save(OmegaConf.create(saved), tmp / "config.yaml")
    os.replace(tmp, final)
    write_text_atomic(out_root / LATEST, final.name + "\n", "convert.out")
    return final


def dcp_to_hf(load: str, out: str, cfg: DictConfig) -> Path:
    """Export the model of checkpoint `load` (a step directory or a root with `latest`) as an HF directory;
    an adapter checkpoint as a PEFT directory (convert.to=peft) or merged into its base (convert.merge_lora)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = resolve_load(load, cfg.checkpoint.dir)
    if not (ckpt / "config.yaml").is_file():
        raise UserError(f"checkpoint.load={load}: {ckpt} has no config.yaml, so its model is unknown; point it at "
                        "a checkpoint written by SpeedLLM")
    if holds_adapters(ckpt) != (cfg.convert.to == "peft" or cfg.convert.merge_lora):
        if holds_adapters(ckpt):
            raise UserError(f"checkpoint.load={load} holds LoRA adapters only; use convert.to=peft for an adapter "
                            "directory or convert.merge_lora=true for merged weights")
        raise UserError(f"checkpoint.load={load} holds no LoRA adapters; use convert.to=hf without "
                        "convert.merge_lora (or a checkpoint of a finetune=lora run)")
    if cfg.convert.to == "peft":
        return export_peft(ckpt, out)
    if cfg.convert.merge_lora:
        return export_merged(ckpt, out, cfg, _dtype(cfg))
    saved = read_saved_config(ckpt)
    metadata = read_metadata(ckpt).state_dict_metadata
    tensors = {key.removeprefix("model."): (tuple(meta.size), meta.properties.dtype)
               for key, meta in metadata.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

    def fetch(names):
        state = {"model": {n: torch.empty(tensors[n][0], dtype=tensors[n][1]) for n in names}}
        dcp_load(state, ckpt)
        return state["model"]

    extras = read_extras(str(ckpt / EXTRAS_DIR)) if has_weights(ckpt / EXTRAS_DIR) else {}
    legacy = {key.removeprefix(EXTRAS + "."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
              for key, meta in metadata.items() if key.startswith(EXTRAS + ".")}  # converted before hf_extras/
    if legacy:
        dcp_load({EXTRAS: legacy}, ckpt)
        extras.update(legacy)

    # The original HF files: kept inside a converted checkpoint, or the directory a training run started from.
    source = ckpt / RELEASE_DIR
    if not source.is_dir():
        load_hf = OmegaConf.select(saved, "checkpoint.load_hf")
        source = Path(load_hf) if load_hf is not None and Path(load_hf).is_dir() else None
    return write_hf_dir(out, saved.model, tensors, fetch, cfg.convert.max_shard_size, _dtype(cfg),
                        str(source) if source is not None else None, OmegaConf.select(saved, "data.tokenizer"),
                        cfg.logging.progress_bar, extras or None)


def run(cfg: DictConfig, rt) -> None:
    """task=convert (one process): convert.to=dcp reads checkpoint.load_hf, convert.to=hf | peft checkpoint.load."""
    with storage.local_output(cfg.convert.out, cfg.data.cache_dir) as out:  # a URL: written here, then uploaded
        if cfg.convert.to == "dcp":
            written = hf_to_dcp(cfg.checkpoint.load_hf, out, cfg)
        elif cfg.quant.name != "none":
            from speedllm.checkpoint.quantized import check_exportable, quantize_hf_dir

            check_exportable(cfg.quant.name)
            fp_dir = dcp_to_hf(cfg.checkpoint.load, str(Path(out).parent / f".{Path(out).name}.fp"), cfg)
            quantize_hf_dir(fp_dir, Path(out), cfg.quant)
            written = Path(out)
        else:
            written = dcp_to_hf(cfg.checkpoint.load, out, cfg)
        index = written / "model.safetensors.index.json"
        shards = len(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else 0
    if storage.is_url(cfg.convert.out):
        written = storage.join(cfg.convert.out, *written.relative_to(out).parts)
    print(f"convert: wrote {written}" + (f" ({shards} safetensors shard(s))" if shards else ""))
