"""LoRA adapters applied from outside the model, named as PEFT names them.

A targeted nn.Linear (its name's last part in finetune.targets, as PEFT's `target_modules`) of the decoder
layers gets two child Linears, `lora_A` [r, in] and `lora_B` [out, r], and a forward hook that adds
scaling * lora_B(lora_A(dropout(x))) to its output, scaling = alpha / r. Our state-dict names are then
PEFT's without its prefix: `layers.0.self_attn.q_proj.lora_A.weight`. Every other parameter is frozen.

Adapters are added after tensor parallelism and before FSDP2: a column-parallel base (weight Shard(0) over
its outputs) gets a replicated A and a B sharded like the base; a row-parallel base (Shard(1), over its
inputs) gets an A sharded over the same inputs and a replicated B. The hook runs before the TP output hook,
on the base's own DTensor input and output, so the adapter's output has the base output's placement
(Shard(-1), or Partial for row-parallel, reduced together with the base output) and DTensor derives the
gradients. A starts as PEFT's default (Kaiming-uniform, one seeded generator per name, so every layout
starts from the same adapters), B at zero: the first step computes exactly the base model.

`finetune.targets` may also name `experts`: every MoE layer's stacked experts get an ExpertLoRA (one A/B pair
per expert for gate and up together, one for down: PEFT's `target_parameters` on transformers' fused
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`), whose terms the experts' grouped matmul adds.

Letters: r adapter rank, E experts, D hidden, I expert intermediate size, N rows.
"""

import contextlib
import math
import zlib
from contextvars import ContextVar
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from speedllm.quant.nf4 import is_nf4, nf4_placeholders

_ENABLED = ContextVar("lora_enabled", default=True)


def is_adapter(name: str) -> bool:
    """True for the state-dict name of an adapter weight."""
    return ".lora_A." in name or ".lora_B." in name


def unwrapped(name: str) -> str:
    """A parameter's name as in the plain model (activation recompute wraps layers)."""
    return name.replace("_checkpoint_wrapped_module.", "")


@contextlib.contextmanager
def adapters_disabled():
    """Run the base model alone (the DPO reference): every adapter hook adds nothing inside this block."""
    token = _ENABLED.set(False)
    try:
        yield
    finally:
        _ENABLED.reset(token)


class LoRAHook:
    """Forward hook of an adapted Linear: output + scaling * B(A(dropout(x)))."""

    def __init__(self, scaling: float, dropout: float):
        self.scaling, self.dropout = scaling, dropout

    def __call__(self, module: nn.Linear, args, output):
        if not _ENABLED.get():
            return output
        x = args[0]
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, module.training)
        return output + module.lora_B(module.lora_A(x)) * self.scaling


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Factors(nn.Module):
    """One side (A or B) of a MoE layer's expert adapters: a stacked tensor per adapted fused weight."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up, self.down = nn.Parameter(gate_up), nn.Parameter(down)


class ExpertLoRA(nn.Module):
    """LoRA on one MoE layer's experts, as PEFT adapts transformers' fused expert weights: per expert, one pair
    on gate_up_proj [2I, D] (A shared by gate and up, B's rows gate | up) and one on down_proj [D, I].

    Weights (our names under `experts.adapter.`): lora_A.gate_up [E, r, D], lora_B.gate_up [E, 2I, r],
    lora_A.down [E, r, I], lora_B.down [E, D, r]. Their expert dim is the experts' own: under expert
    parallelism they are sharded on it like the experts (each rank's grouped matmuls use its local experts').
    """

    def __init__(self, experts: nn.Module, rank: int, scaling: float):
        super().__init__()
        self.scaling = scaling
        weight = experts.gate_proj
        num_experts, hidden, dim = weight.shape

        def new(*shape):
            t = torch.empty(shape, device=weight.device, dtype=weight.dtype)
            return distribute_tensor(t, weight.device_mesh, weight.placements) if isinstance(weight, DTensor) else t

        self.lora_A = _Factors(new(num_experts, rank, dim), new(num_experts, rank, hidden))
        self.lora_B = _Factors(new(num_experts, 2 * hidden, rank), new(num_experts, dim, rank))

    def _term(self, x_N: torch.Tensor, counts_E: torch.Tensor, ops, a: torch.Tensor, b: torch.Tensor):
        return ops.grouped_mm(ops.grouped_mm(x_N, _local(a), counts_E), _local(b), counts_E) * self.scaling

    def gate_up(self, x_ND, counts_E, ops, gate_NI, up_NI):
        if not _ENABLED.get():
            return gate_NI, up_NI
        gate, up = self._term(x_ND, counts_E, ops, self.lora_A.gate_up, self.lora_B.gate_up).chunk(2, dim=-1)
        return gate_NI + gate, up_NI + up

    def down(self, h_NI, counts_E, ops, y_ND):
        if not _ENABLED.get():
            return y_ND
        return y_ND + self._term(h_NI, counts_E, ops, self.lora_A.down, self.lora_B.down)


# Our merged weights each expert adapter changes: gate_up's delta is gate's rows then up's (transformers' order)
EXPERT_WEIGHTS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
EXPERTS = "experts"  # the finetune.targets name of every MoE layer's experts


def target_experts(model: nn.Module, targets: Iterable[str]) -> Dict[str, nn.Module]:
    """name -> experts module of every MoE layer when `targets` names `experts` (unwrapped names)."""
    if EXPERTS not in targets:
        return {}
    return {unwrapped(name): module for name, module in model.named_modules()
            if name.startswith("layers.") and name.endswith(".mlp.experts")}


def target_linears(model: nn.Module, targets: Iterable[str]) -> Dict[str, nn.Linear]:
    """name -> Linear of the decoder layers whose last name part is in `targets` (unwrapped names)."""
    targets = set(targets)
    return {unwrapped(name): module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("layers.") and name.rsplit(".", 1)[-1] in targets}


def _adapter_placements(weight: torch.Tensor):
    """(A's, B's) placements for a base weight [out, in]: None for a plain tensor."""
    if not isinstance(weight, DTensor):
        return None
    (placement,) = weight.placements  # the tensor-parallel placement (FSDP2 comes later)
    if placement == Shard(0):
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


def _adapter_linear(in_features: int, out_features: int, weight: torch.Tensor, placements) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=False, device=weight.device, dtype=weight.dtype)
    if placements is not None:
        linear.weight = nn.Parameter(distribute_tensor(linear.weight, weight.device_mesh, placements))
    return linear


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: Iterable[str],
               nf4: bool = False) -> List[str]:
    """Freeze every parameter of `model` (a Qwen3 or a pipeline stage, on the meta device, after TP) and add
    adapters to the targeted Linears (and experts); `nf4` (QLoRA) makes the targeted Linears' weights NF4
    placeholders (speedllm.quant.nf4) that loading fills. Returns the adapted module names."""
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = target_linears(model, targets)
    for module in adapted.values():
        if hasattr(module, "lora_A"):  # a pipeline rank's stages share their layers with the rank module
            continue
        placements = _adapter_placements(module.weight)
        a_place, b_place = placements if placements is not None else (None, None)
        module.lora_A = _adapter_linear(module.in_features, rank, module.weight, a_place)
        module.lora_B = _adapter_linear(rank, module.out_features, module.weight, b_place)
        # before tensor parallelism's output hook: the adapter sees the base's DTensor input and output
        module.register_forward_hook(LoRAHook(alpha / rank, dropout), prepend=True)
    experts = target_experts(model, targets)
    for module in experts.values():
        if module.adapter is None:
            module.adapter = ExpertLoRA(module, rank, alpha / rank)
    if nf4:
        nf4_placeholders({name: module for name, module in adapted.items() if not is_nf4(module.weight)})
    return sorted(adapted) + sorted(experts)


def copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (replicated) tensor into `target`, keeping only the piece a DTensor target holds."""
    if isinstance(target, DTensor):
        # From a replicated view to the target's placements is a local slice: no communication.
        whole = DTensor.from_local(full.to(target.device), target.device_mesh,
                                   [Replicate()] * target.device_mesh.ndim, run_check=False)
        target.to_local().copy_(whole.redistribute(placements=target.placements).to_local())
    else:
        target.copy_(full)


@torch.no_grad()
def init_adapters(modules: List[nn.Module], seed: int) -> None:
    """A: Kaiming-uniform (PEFT's default) from a generator seeded by (seed, name); B: zeros."""
    for module in modules:
        for name, param in module.named_parameters():
            name = unwrapped(name)
            if not is_adapter(name):
                continue
            if ".lora_B." in name:
                full = torch.zeros(param.shape, dtype=param.dtype)
            else:
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                bound = 1.0 / math.sqrt(param.shape[-1])  # kaiming_uniform_(a=sqrt(5)) of nn.Linear
                full = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            copy_full_(param, full.to(param.dtype))


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The weight change [out, in] ([E, out, in] for experts) an adapter stands for: scaling * B @ A (in fp32)."""
    return (b.float() @ a.float()) * scaling


def merged_state_dict(state: Dict[str, torch.Tensor], scaling: float) -> Dict[str, torch.Tensor]:
    """A whole (unsharded) state dict with adapters folded into their base weights and removed."""
    out = {name: t for name, t in state.items() if not is_adapter(name)}
    for name in state:
        if name.endswith(".lora_A.weight"):
            prefix = name.removesuffix(".lora_A.weight")
            base = out[f"{prefix}.weight"]
            delta = lora_delta(state[name], state[f"{prefix}.lora_B.weight"], scaling)
            out[f"{prefix}.weight"] = (base.float() + delta).to(base.dtype)
        for fused, weights in EXPERT_WEIGHTS.items():
            if name.endswith(f".adapter.lora_A.{fused}"):
                prefix = name.removesuffix(f".adapter.lora_A.{fused}")
                delta = lora_delta(state[name], state[f"{prefix}.adapter.lora_B.{fused}"], scaling)
                for weight, part in zip(weights, delta.chunk(len(weights), dim=1)):
                    base = out[f"{prefix}.{weight}"]
                    out[f"{prefix}.{weight}"] = (base.float() + part).to(base.dtype)
    return out


def adapter_fn(ft) -> Optional[Callable[[nn.Module], List[str]]]:
    """What parallelize applies to each model part for finetune=lora|qlora (None for full fine-tuning)."""
    if ft.name == "full":
        return None
    return partial(apply_lora, rank=ft.rank, alpha=ft.alpha, dropout=ft.dropout, targets=list(ft.targets),
                   nf4=ft.name == "qlora")
