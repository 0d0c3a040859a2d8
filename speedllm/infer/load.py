"""The model and tokenizer an inference task runs: built on the meta device, placed, then loaded.

Weights come from our DCP checkpoints (`checkpoint.load=<step dir | checkpoints dir>`, saved under any
layout) or a Hugging Face directory (`checkpoint.load_hf=<dir>`, normally with model=hf).
"""

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from speedllm.errors import UserError
from speedllm.finetune.lora import adapter_fn
from speedllm.hardware import DTYPES
from speedllm.quant import quantize_for_inference
from speedllm.runtime import Runtime


def adopt_checkpoint_config(cfg: DictConfig) -> bool:
    """With checkpoint.load, the architecture and tokenizer the checkpoint was trained with replace cfg's;
    returns whether they did.

    The launcher calls this after validating and before freezing, so <run_dir>/config.yaml is the model that runs.
    (An HF directory needs nothing here: model=hf reads its config.json, and validation has already
    checked any other model= against it.)
    """
    from speedllm.checkpoint.dcp import read_saved_config, resolve_load

    ck = cfg.checkpoint
    if ck.load_hf is not None:
        return False
    if ck.load is None:
        raise UserError(f"task={cfg.task.name} needs weights: checkpoint.load=<checkpoint dir> (from a training "
                        "run) or checkpoint.load_hf=<Hugging Face model dir> (with model=hf)")
    path = resolve_load(ck.load, ck.dir)
    if path is None:
        raise UserError(f"checkpoint.load={ck.load}: no checkpoint there yet; point it at a step_* directory or a "
                        "checkpoints directory")
    frozen = path / "config.yaml"
    with open_dict(cfg):
        ck.load = str(path)
        if not frozen.is_file():
            return False
        saved = read_saved_config(path)
        if saved.model != cfg.model:
            print(f"model and tokenizer from {frozen}: {saved.model.name}")
        cfg.model = OmegaConf.merge(cfg.model, saved.model)
        cfg.data.tokenizer = saved.data.tokenizer
        if OmegaConf.select(saved, "finetune.name", default="full") != "full":  # an adapter run: its adapters
            cfg.finetune = OmegaConf.merge(cfg.finetune, saved.finetune)
    return True


def load_weights(model: nn.Module, cfg: DictConfig) -> None:
    """Fill the (materialized, possibly tensor-parallel) model from checkpoint.load_hf or checkpoint.load."""
    if cfg.checkpoint.load_hf is not None:
        from speedllm.checkpoint.hf import load_hf_weights

        load_hf_weights(model, cfg.checkpoint.load_hf)
        return
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from speedllm.checkpoint.dcp import dcp_load

    # Only the "model" part of a training checkpoint; DCP reshards it to this layout.
    state = {"model": get_model_state_dict(model)}
    dcp_load(state, Path(cfg.checkpoint.load))
    set_model_state_dict(model, state["model"])


def load_model(cfg: DictConfig, rt: Runtime) -> nn.Module:
    """The inference model of this rank: eval mode, weights loaded, in hardware.dtype, quantized for quant=."""
    from speedllm.models.qwen3 import Qwen3

    with torch.device("meta"):
        model = Qwen3(cfg.model, ops=cfg.hardware.ops)
    model.to(DTYPES[cfg.hardware.dtype])  # still on meta: weights are allocated, and loaded, in this dtype only
    if cfg.parallel.tp > 1:
        from speedllm.parallel.tensor import apply_tp

        # No sequence parallel: a decode step has one token per row, nothing to split along the sequence.
        apply_tp(model, rt.mesh["tp"], sequence_parallel=False)
    adapt = adapter_fn(cfg.finetune)
    if adapt is not None:
        adapt(model)
    model.to_empty(device=rt.device)
    model.tie_embeddings()  # to_empty() unties shared weights
    if adapt is None:
        load_weights(model, cfg)
    else:
        load_adapted_weights(model, cfg)
    return quantize_for_inference(model.eval(), cfg.quant)


def load_adapted_weights(model: nn.Module, cfg) -> None:
    """A LoRA model: the base (checkpoint.load_hf, or checkpoint.load naming full weights), then the adapters of
    finetune.adapter (a PEFT directory) or of checkpoint.load naming an adapter run's checkpoint."""
    from pathlib import Path

    from speedllm.finetune.base import load_base
    from speedllm.finetune.export import read_adapters
    from speedllm.finetune.lora import copy_full_, init_adapters

    init_adapters([model], cfg.seed)
    adapters = load_base([model], cfg, Path(cfg.checkpoint.load) if cfg.checkpoint.load is not None else None)
    if adapters is not None:
        with torch.no_grad():
            for name, tensor in read_adapters(adapters).items():
                target = model.get_parameter(name)
                copy_full_(target, tensor.to(target.dtype))


def load_tokenizer(cfg: DictConfig):
    """The tokenizer of data.tokenizer (for a checkpoint: the one it was trained with)."""
    from speedllm.data.tokenizer import load_tokenizer as load

    return load(str(cfg.data.tokenizer), cfg.data.trust_remote_code)


def stop_ids_of(tokenizer) -> list:
    """Token ids that end a completion: eos, Qwen's end of turn and end of text, when the tokenizer has them."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def pad_id_of(tokenizer) -> int:
    """The id that fills left padding and finished rows (never attended to, never returned)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return tid
    return 0
