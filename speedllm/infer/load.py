"""The model and tokenizer an inference task runs: built on the meta device, placed, then loaded.

Weights come from our DCP checkpoints (`checkpoint.load=<step dir | checkpoints dir>`, saved under any
layout) or a Hugging Face directory (`checkpoint.load_hf=<dir>`, normally with model=hf).
"""

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from speedllm.errors import UserError
from speedllm.hardware import DTYPES
from speedllm.parallel.weights import tie_embeddings
from speedllm.runtime import Runtime


def adopt_checkpoint_config(cfg: DictConfig) -> bool:
    """With checkpoint.load, the architecture and tokenizer the checkpoint was trained with replace cfg's;
    returns whether they did.

    The launcher calls this after validating and before freezing, so <run_dir>/config.yaml is the model that runs.
    (An HF directory needs nothing here: model=hf reads its config.json, and validation has already
    checked any other model= against it.)
    """
    from speedllm.checkpoint.dcp import resolve_load

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
        saved = OmegaConf.load(frozen)
        if saved.model != cfg.model:
            print(f"model and tokenizer from {frozen}: {saved.model.name}")
        cfg.model = OmegaConf.merge(cfg.model, saved.model)
        cfg.data.tokenizer = saved.data.tokenizer
    return True


def load_weights(model: nn.Module, cfg: DictConfig) -> None:
    """Fill the (materialized, possibly tensor-parallel) model from checkpoint.load_hf or checkpoint.load."""
    if cfg.checkpoint.load_hf is not None:
        from speedllm.checkpoint.hf import load_hf_weights

        load_hf_weights(model, cfg.checkpoint.load_hf)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from speedllm.checkpoint.dcp import _quiet_dcp

    # Only the "model" part of a training checkpoint; DCP reshards it to this layout.
    state = {"model": get_model_state_dict(model)}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=cfg.checkpoint.load, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])


def load_model(cfg: DictConfig, rt: Runtime) -> nn.Module:
    """The inference model of this rank: eval mode, weights loaded, in hardware.dtype."""
    from speedllm.models.qwen3 import Qwen3

    with torch.device("meta"):
        model = Qwen3(cfg.model, ops=cfg.hardware.ops)
    model.to(DTYPES[cfg.hardware.dtype])  # still on meta: weights are allocated, and loaded, in this dtype only
    if cfg.parallel.tp > 1:
        from speedllm.parallel.tensor import apply_tp

        # No sequence parallel: a decode step has one token per row, nothing to split along the sequence.
        apply_tp(model, rt.mesh["tp"], sequence_parallel=False)
    model.to_empty(device=rt.device)
    tie_embeddings(model)  # to_empty() unties shared weights
    load_weights(model, cfg)
    return model.eval()


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
