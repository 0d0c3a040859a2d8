"""The model and tokenizer an inference task runs: built on the meta device, placed, then loaded.

Weights come from our DCP checkpoints (`checkpoint.load=<step dir | checkpoints dir>`, saved under any
layout) or a Hugging Face directory (`checkpoint.load_hf=<dir>`, normally with model=hf).
"""

import functools
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from speedllm.adapters.lora import adapter_fn
from speedllm.hardware import DTYPES
from speedllm.quant import inference_scheme, own_cpu_layers, quantize_for_inference, quantize_linears
from speedllm.runtime import Runtime


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
    from speedllm.ops.loss import chunked_cross_entropy
    from speedllm.parallel.tensor import apply_tp, quantize_tp_linear, vocab_parallel_output_loss

    adapt = adapter_fn(cfg.finetune)
    tables = own_cpu_layers(cfg.quant.name, rt.device)
    # (task=evaluate's loss) under TP the output projection is vocabulary-parallel, unless it is the int8 table,
    # which every rank holds whole (speedllm.quant.quantize_embeddings)
    vocab_parallel = cfg.parallel.tp > 1 and not tables
    with torch.device("meta"):
        model = Qwen3(cfg.model, ops=cfg.hardware.ops,
                      output_loss=vocab_parallel_output_loss if vocab_parallel else chunked_cross_entropy)
    model.to(DTYPES[cfg.hardware.dtype])  # still on meta: weights are allocated, and loaded, in this dtype only
    if cfg.parallel.tp > 1:
        # No sequence parallel: a decode step has one token per row, nothing to split along the sequence.
        apply_tp(model, rt.mesh["tp"], sequence_parallel=False)
    tp_linear = quantize_tp_linear if cfg.parallel.tp > 1 else None  # each rank quantizes its own shards
    if adapt is not None:
        adapt(model)
    elif tables:
        load_quantized(model, cfg, rt.device, tp_linear)
        return model.eval()
    model.to_empty(device=rt.device)
    model.tie_embeddings()  # to_empty() unties shared weights
    if adapt is None:
        load_weights(model, cfg)
    else:
        load_adapted_weights(model, cfg)
    return quantize_for_inference(model.eval(), cfg.quant, tp_linear)


@torch.no_grad()
def load_quantized(model: nn.Module, cfg: DictConfig, device: torch.device, tp_linear=None) -> None:
    """Fill the meta-device model one piece at a time, quantizing each piece as it is read: the embedding (and
    an untied output projection) in blocks of rows, then each layer, then the final norm. The full-precision
    model never exists whole: the peak is the quantized model plus one layer (plus, from a DCP checkpoint,
    the full-precision embedding table, which DCP reads whole). Under tensor parallelism a rank reads and
    quantizes only its shards of each layer, and the int8 tables whole (speedllm.quant.quantize_embeddings)."""
    from speedllm.quant.int8 import Int8Embedding, Int8Linear

    source = WeightSource(cfg, model.cfg)
    dtype = model.embed_tokens.weight.dtype
    embed = source.int8_table("embed_tokens.weight", model.embed_tokens.weight.shape, dtype)
    head = embed if model.cfg.tie_word_embeddings else source.int8_table("lm_head.weight",
                                                                          model.lm_head.weight.shape, dtype)
    model.embed_tokens = Int8Embedding(*embed, dtype)
    model.lm_head = Int8Linear(*head, dtype, dynamic=inference_scheme(cfg.quant.name) == "int8_dyn")
    fill_layers(model, source, device, lambda layer: quantize_linears(layer, cfg.quant, tp_linear))
    model.norm.to_empty(device=device)
    source.fill(model.norm, "norm.")


def fill_layers(model: nn.Module, source: "WeightSource", device: torch.device, quantize) -> None:
    """Materialize and read the meta-device model's decoder layers one at a time, each quantized in place
    (`quantize(layer)`) before the next is read, and the heap trimmed after each."""
    for key, layer in model.layers.items():
        layer.to_empty(device=device)
        source.fill(layer, f"layers.{key}.")
        quantize(layer)
        trim_heap()


@functools.cache
def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name is not None else None


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). The layers' fp32
    tensors are below glibc's adaptive mmap threshold, so they come from the heap, and the int8 tensors made
    between them would otherwise pin the freed ones: measured 1.77 vs 1.10 GiB peak loading qwen3_0.6b int8."""
    if _libc() is not None and hasattr(_libc(), "malloc_trim"):
        _libc().malloc_trim(0)


class WeightSource:
    """Reads pieces of checkpoint.load_hf or checkpoint.load; each read maps and reads only its own tensors."""

    def __init__(self, cfg: DictConfig, model_cfg):
        self.model_cfg, self.hf = model_cfg, cfg.checkpoint.load_hf
        self.dcp = None if self.hf is not None else Path(cfg.checkpoint.load)
        if self.hf is not None:
            from speedllm.checkpoint.hf import check_hf_files, read_hf_config, weight_files

            read_hf_config(self.hf)
            self.files = weight_files(self.hf)
            check_hf_files(self.hf, model_cfg, self.files)

    def read(self, tensors: dict, rows: slice = None) -> None:
        """Fill {name: tensor} in place (plain tensors or tensor-parallel DTensors; with `rows`: that block of
        rows of each plain tensor, from an HF directory)."""
        if self.dcp is not None:
            from speedllm.checkpoint.dcp import dcp_load

            return dcp_load({"model": tensors}, self.dcp)
        from torch.distributed.tensor import DTensor

        from speedllm.checkpoint.hf import hf_reader, local_slices

        with hf_reader(self.hf, self.model_cfg, self.files) as read:  # closed after each piece: pages unmapped
            for name, target in tensors.items():
                index = local_slices(target)  # a tensor-parallel shard: only its own block is read
                if rows is not None:
                    index = (rows,) + index[1:]
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(read(name, target.shape, index))

    def fill(self, module: nn.Module, prefix: str) -> None:
        self.read({prefix + name: t for name, t in module.state_dict().items()})

    def int8_table(self, name: str, shape, dtype, block: int = 8192):
        """(q int8, scale fp32) of a [rows, D] table; from an HF directory read block by block of rows."""
        from speedllm.quant.int8 import quantize_int8

        if self.dcp is not None:
            whole = torch.empty(shape, dtype=dtype)
            self.read({name: whole})
            return quantize_int8(whole)
        q, scale = torch.empty(shape, dtype=torch.int8), torch.empty(shape[0])
        for start in range(0, shape[0], block):
            rows = slice(start, min(start + block, shape[0]))
            part = torch.empty(rows.stop - rows.start, shape[1], dtype=dtype)
            self.read({name: part}, rows)
            q[rows], scale[rows] = quantize_int8(part)
        return q, scale


def load_adapted_weights(model: nn.Module, cfg) -> None:
    """A LoRA model: the base (checkpoint.load_hf, or checkpoint.load naming full weights), then the adapters of
    finetune.adapter (a PEFT directory) or of checkpoint.load naming an adapter run's checkpoint."""
    from pathlib import Path

    from speedllm.adapters.lora import copy_full_, init_adapters
    from speedllm.checkpoint.adapters import load_base, read_adapters

    init_adapters([model], cfg.seed)
    adapters = load_base([model], cfg, Path(cfg.checkpoint.load) if cfg.checkpoint.load is not None else None)
    if adapters is not None:
        with torch.no_grad():
            for name, tensor in read_adapters(adapters).items():
                target = model.get_parameter(name)
                copy_full_(target, tensor.to(target.dtype))
