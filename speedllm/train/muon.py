"""optim=muon: torch's Muon update on the hidden matrices, AdamW on everything else, in one optimizer.

One optimizer (not two) so the loop, the lr schedule, gradient clipping and DCP checkpoints see what they see for
AdamW: one state dict keyed by parameter name, one LambdaLR scaling every group's peak lr by the same factor.
Which parameters are Muon's is decided by speedllm.train.optimizer.muon_param_groups; each group says so with
its "muon" flag.

Muon's step is torch.optim.Muon's (momentum, Nesterov, Newton-Schulz orthogonalization, its lr adjustment and
decoupled weight decay), written here around torch's `_adjust_lr` for three things torch's class does not do:
  - sharded parameters (FSDP2, TP, EP DTensors): Newton-Schulz needs the whole matrix, so the update of each
    matrix is gathered in full on every rank, orthogonalized there, and each rank keeps its own shard of the
    result (`_full` / `_shard_like`). Cost per step: every rank receives, for every Muon matrix, the shards it does
    not hold of the update in the Newton-Schulz dtype, i.e. (1 - 1/shards) x numel x 2 bytes in bfloat16 (4 in
    float32) -- about half of one FSDP all-gather of the hidden weights in bf16 -- and every rank runs the
    Newton-Schulz of every matrix (redundant compute; torchtitan's distributed Muon instead gives each matrix to
    one owner rank and scatters the result, which divides that compute by the number of ranks).
  - stacked experts ([E, out, in]): each expert's matrix is orthogonalized on its own (Muon is defined on 2-D
    matrices; torch's class refuses 3-D parameters), with the lr adjustment of one expert's [out, in] shape.
  - the Newton-Schulz dtype: torch's iteration always runs in bfloat16; `ns_dtype` keeps that on accelerators
    and picks float32 on CPUs, where bfloat16 matmuls are ~50x slower (the demo's step would take 14 s, not 0.3 s).
"""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def orthogonalize(update: torch.Tensor, ns_coefficients, ns_steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration (torch.optim._muon._zeropower_via_newtonschulz) in `dtype`:
    in bfloat16 it is the same sequence of operations, so the same bits (tests/test_muon.py holds it to torch's)."""
    a, b, c = ns_coefficients
    x = update.to(dtype, copy=True)  # never the momentum buffer itself (float32, no Nesterov)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` under `param`'s placements (a local slice: no communication)."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameter groups flagged "muon", AdamW on the others.

    Args:
        params: parameter groups, each with "muon": True | False; a group's own "weight_decay" wins (the
            undecayed norms), every other setting comes from the arguments below.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: torch.optim.Muon's,
            for the Muon groups.
        ns_dtype: dtype of the Newton-Schulz iteration, "bfloat16" (torch's) or "float32".
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's lr, betas, eps, weight_decay for the
            other groups.
        fused, foreach: AdamW's kernel choice (speedllm.train.optimizer.fused_adamw decides a null).
    """

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=(3.4445, -4.7750, 2.0315), eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn=None, ns_dtype: str = "bfloat16", adamw_lr: float = 3e-3,
                 adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.1,
                 fused=None, foreach=None):
        muon = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype}
        adam = {"lr": adamw_lr, "weight_decay": adamw_weight_decay, "betas": tuple(adamw_betas), "eps": adamw_eps,
                "fused": bool(fused), "foreach": foreach}
        groups = [{**(muon if g["muon"] else adam), **g} for g in params]
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim._muon import _adjust_lr  # private: imported where Muon runs, not by validation

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                for p in params:
                    self._muon_update(p, group, _adjust_lr)
            elif params:
                self._adamw_update(params, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict, adjust_lr) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
        dtype = NS_DTYPES[group["ns_dtype"]]
        full = _full(update.to(dtype))  # gathered in the Newton-Schulz dtype: half the bytes in bfloat16
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
        if full.ndim == 3:  # stacked experts: one matrix each
            ortho = torch.stack([orthogonalize(m, *ns) for m in full])
        else:
            ortho = orthogonalize(full, *ns)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(_shard_like(ortho, p), alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))

    def _adamw_update(self, params: list, group: dict) -> None:
        """torch.optim.AdamW's step (its functional form) with AdamW's state names, so the state reads like its."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if group["fused"]
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], foreach=group["foreach"], fused=group["fused"], amsgrad=False,
              beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=False)
