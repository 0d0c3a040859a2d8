"""Quantization applied from outside the model (`quant=` config group), like parallelism.

Which weights: the projections of attention and of the dense MLP (`QUANTIZED`); on CPUs under the schemes with
our own layers (`CPU_LAYERS`) also the embedding and the output projection, as one int8 table (`quantize_embeddings`; tied, one table
serves both). Norms and the MoE router stay in full precision; MoE experts too (their weights are stacked 3-D
tensors used by a grouped matmul, which neither torchao's `quantize_` nor torch's packed matmuls take).

    inference (task=generate/chat/evaluate/convert): quantize_for_inference() on a loaded model, or
    speedllm.generation.load.load_quantized() while loading (CPU, CPU_LAYERS)
        int8_wo   CPU: speedllm.quant.int8 (torchao's int8 numbers, our C kernel); GPU: torchao Int8WeightOnlyConfig
        int4_wo   CPU: speedllm.quant.int4 (torchao's int4 numbers, our C kernel); GPU: torchao Int4WeightOnlyConfig
        int8_dyn  CPU: speedllm.quant.int8 with int8 activations (integer dot products); GPU: torchao
                  Int8DynamicActivationInt8WeightConfig
        qat_int4  = int4_wo (the scheme it was trained against)
        float8    torchao Float8DynamicActivationFloat8WeightConfig (float8 hardware only)
    under tensor parallelism each rank quantizes its own shards, with tp=1's numbers for the weight-only schemes
    (the loader passes speedllm.parallel.tensor.quantize_tp_linear in); the int8 tables are whole on every rank
    training (task=pretrain/sft): prepare_for_training() before FSDP, on the meta-device model
        float8    torchao convert_to_float8_training (tensorwise with FSDP2 float8 all-gather, or rowwise)
        qat_int4  torchao QAT: weights fake-quantized with int4_wo's exact scheme
"""

import torch
from torch import nn

from speedllm.models.config import PROJECTIONS

QUANT_NAMES = ("none", "int8_wo", "int4_wo", "int8_dyn", "float8", "qat_int4")
TRAINING = ("none", "float8", "qat_int4")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
CPU_LAYERS = ("int8_wo", "int4_wo", "int8_dyn")  # inference schemes with our own CPU layers (quant.int8 / int4)
QUANTIZED = PROJECTIONS


def is_quantized(module: nn.Module, fqn: str) -> bool:
    """The linear layers quantization applies to (see the module docstring for what stays full precision)."""
    return isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] in QUANTIZED


def inference_scheme(name: str) -> str:
    """The weight format an inference task uses for quant=name (a QAT run is served as the int4 it trained for)."""
    return "int4_wo" if name == "qat_int4" else name


def bytes_per_weight(name: str, dtype_bytes: float, group_size: int = 128) -> float:
    """Stored bytes per quantized weight at inference (scales and zeros included), for the planner.

    int8: one byte plus one fp32 scale per output row (negligible); int4: half a byte plus a scale and zero per
    group (the CPU kernel keeps them in fp32: 8 bytes per group; torchao's GPU int4 keeps 4, a 3% overcount at
    group 128).
    """
    scheme = inference_scheme(name)
    if scheme in ("int8_wo", "int8_dyn"):
        return 1.0
    if scheme == "int4_wo":
        return 0.5 + 8.0 / group_size
    if scheme == "float8":
        return 1.0
    return dtype_bytes


def int8_tables(name: str) -> bool:
    """Whether quant=name keeps the embedding and output projection in int8: the CPU_LAYERS schemes on CPUs,
    where the int8 kernels are (the planner counts this format; on GPUs torchao quantizes the projections only)."""
    return inference_scheme(name) in CPU_LAYERS


def own_cpu_layers(name: str, device: torch.device) -> bool:
    """Whether quant=name on `device` runs on our own CPU layers (speedllm.quant.int8 / int4 projections and the
    int8 tables) rather than torchao's: the CPU_LAYERS schemes on CPUs."""
    return device.type == "cpu" and int8_tables(name)


def _swap_linears(model: nn.Module, make) -> None:
    """Replace every quantized nn.Linear with make(linear) (a new module; the parent's attribute is rebound)."""
    for fqn, module in list(model.named_modules()):
        if is_quantized(module, fqn):
            parent_name, _, child = fqn.rpartition(".")
            model.get_submodule(parent_name).register_module(child, make(module))


def quantize_embeddings(model: nn.Module, dynamic: bool = False) -> None:
    """The embedding and output projection of a Qwen3 (or of its pipeline stage) in int8, per row; tied, they
    share one int8 table. At batch-1 decode the output projection is the largest single read (a quarter of
    qwen3_0.6b's weights).

    Under tensor parallelism every rank holds the whole table, not a vocabulary shard: the int8 table is smaller
    than the fp32 shard it replaces while tp < 4, one table still serves the tied pair, and no rank has to
    all-reduce the embedding or all-gather the logits (plain modules, no DTensor hooks). dynamic: the output
    projection quantizes its activations too (quant=int8_dyn).
    """
    from torch.distributed.tensor import DTensor

    from speedllm.quant.int8 import Int8Embedding, Int8Linear, quantize_int8

    def whole(weight):
        return weight.full_tensor() if isinstance(weight, DTensor) else weight

    embed, head = model.embed_tokens, model.lm_head
    if embed is not None:
        table = quantize_int8(whole(embed.weight))
        model.embed_tokens = Int8Embedding(*table, embed.weight.dtype)
    if head is not None:
        tied = embed is not None and head.weight is embed.weight
        model.lm_head = Int8Linear(*(table if tied else quantize_int8(whole(head.weight))), head.weight.dtype,
                                   dynamic)


@torch.no_grad()
def quantize_for_inference(model: nn.Module, quant, tp_linear=None) -> nn.Module:
    """Quantize the loaded full-precision model in place for quant.name (see the module docstring); returns it.

    Args:
        quant: the `quant` config section (name, group_size).
        tp_linear: for a tensor-parallel model, how a sharded linear is quantized (see quantize_linears).
    """
    scheme = inference_scheme(quant.name)
    if scheme == "none":
        return model
    if own_cpu_layers(scheme, next(model.parameters()).device):
        quantize_embeddings(model, scheme == "int8_dyn")
    quantize_linears(model, quant, tp_linear)
    return model


@torch.no_grad()
def quantize_linears(module: nn.Module, quant, tp_linear=None, device=None) -> None:
    """Quantize the linear layers of `module` (a model, or one layer of it) that quantization applies to.

    Under tensor parallelism each rank quantizes its own shards: `tp_linear(linear, quantize)` (the loader passes
    speedllm.parallel.tensor.quantize_tp_linear) makes the layer of a DTensor-sharded linear from `quantize`.
    device: whose layers to use (default: the module's device; task=dryrun quantizes a meta-device model as CPU).
    """

    scheme = inference_scheme(quant.name)
    own_kernels = own_cpu_layers(scheme, device or next(module.parameters()).device)

    def quantize(linear: nn.Linear, group=None) -> nn.Module:
        if own_kernels:
            from speedllm.quant.int4 import Int4Linear
            from speedllm.quant.int8 import Int8Linear

            if scheme in ("int8_wo", "int8_dyn"):
                return Int8Linear.from_linear(linear, group, dynamic=scheme == "int8_dyn")
            return Int4Linear.from_linear(linear, quant.group_size)
        from torchao.quantization import quantize_

        quantize_(linear, torchao_inference_config(scheme, quant))  # in place (int8_dyn: row scales per shard)
        return linear

    _swap_linears(module, quantize if tp_linear is None else lambda linear: tp_linear(linear, quantize))


def torchao_inference_config(scheme: str, quant):
    """The torchao config of an inference scheme (int4 only where torchao has kernels for the device: GPUs)."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    return {
        "int8_wo": lambda: Int8WeightOnlyConfig(),
        "int4_wo": lambda: Int4WeightOnlyConfig(group_size=quant.group_size),
        "int8_dyn": lambda: Int8DynamicActivationInt8WeightConfig(),
        "float8": lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
    }[scheme]()


def qat_int4_config(group_size: int):
    """torchao's fake quantization that reproduces speedllm.quant.int4.quantize_int4 (tinygemm asymmetric int4)."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.quant_primitives import ZeroPointDomain

    return IntxFakeQuantizeConfig(torch.uint4, group_size=group_size, is_symmetric=False,
                                  scale_precision=torch.float32, zero_point_precision=torch.float32,
                                  zero_point_domain=ZeroPointDomain.FLOAT)


def prepare_for_training(model: nn.Module, quant, device: torch.device) -> None:
    """float8 or QAT wrappers on the linear layers of a (meta-device, TP-placed) model part, before FSDP2."""
    if quant.name == "qat_int4":
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig

        quantize_(model, QATConfig(weight_config=qat_int4_config(quant.group_size), step="prepare"),
                  filter_fn=is_quantized)
    elif quant.name == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            from speedllm.errors import UserError

            raise UserError(f"quant=float8 needs float8 matmuls (SM 8.9+), but {torch.cuda.get_device_name(device)} "
                            "has none; use quant=none (bf16)")
        config = Float8LinearConfig.from_recipe_name(quant.recipe)
        if quant.recipe == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=quant.fsdp_float8_all_gather)
        convert_to_float8_training(model, module_filter_fn=is_quantized, config=config)
