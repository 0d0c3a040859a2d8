"""The MLPs: Qwen3's dense SwiGLU, and the Qwen3-MoE sparse block: softmax router, top-k experts stored stacked for
one grouped matmul per projection, and (Qwen3.5-MoE, Qwen3-Next) a shared expert gated by sigmoid(Linear(D -> 1)).

Letters: N tokens, D hidden, I expert intermediate size, E experts, k experts per token.
"""

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from speedllm.ops import Ops
from speedllm.ops.batch_invariant import elementwise


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Experts(nn.Module):
    """Every expert's SwiGLU weights as one [E, out, in] tensor per projection (the HF per-expert Linear layout)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        # LoRA adapters on these weights, attached from outside (speedllm.adapters.lora.ExpertLoRA); None: none
        self.adapter = None

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor, ops: Ops) -> torch.Tensor:
        """x_ND: token rows sorted by expert, counts_E rows per expert."""
        return swiglu_experts(x_ND, counts_E, ops, self.gate_proj, self.up_proj, self.down_proj, self.adapter)


def swiglu_experts(x_ND: torch.Tensor, counts_E: torch.Tensor, ops: Ops, gate_EID: torch.Tensor,
                   up_EID: torch.Tensor, down_EDI: torch.Tensor, adapter=None) -> torch.Tensor:
    """Every expert's SwiGLU over its block of rows, one grouped matmul per projection; `adapter` (an ExpertLoRA)
    adds its low-rank terms to the projections' outputs, with grouped matmuls of its own."""
    gate_NI, up_NI = ops.grouped_mm(x_ND, gate_EID, counts_E), ops.grouped_mm(x_ND, up_EID, counts_E)
    if adapter is not None:
        gate_NI, up_NI = adapter.gate_up(x_ND, counts_E, ops, gate_NI, up_NI)
    h_NI = ops.swiglu(gate_NI, up_NI)
    y_ND = ops.grouped_mm(h_NI, down_EDI, counts_E)
    return y_ND if adapter is None else adapter.down(h_NI, counts_E, ops, y_ND)


class MoE(nn.Module):
    """Routes each token to its top-k experts and sums their outputs weighted by the router probabilities; with
    cfg.shared_expert_intermediate_size, adds a shared expert's output times sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg, ops: Ops):
        super().__init__()
        self.ops = ops
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, ops)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        # Expert load of the training forwards since the last `take_expert_load`: tokens routed to each expert,
        # router entropy summed over tokens, tokens. Not state: checkpoints leave it out.
        self.register_buffer("load_tally", torch.zeros(cfg.num_experts + 2), persistent=False)
        # Router replay (speedllm.models.moe.Routes, set by record_routes / replay_routes); None: the router decides.
        self.routes = None

    def forward(
        self, x_BSD: torch.Tensor, token_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Returns the block output and the routing statistics of this layer.

        The statistics are (top-k assignments per expert, router probability mass per expert, tokens counted,
        router entropy summed over tokens), with padding tokens (token_mask 0) left out; the model combines the
        first three over layers into the aux loss and records all of them (`record_load`).
        """
        x_ND = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_NE = self.gate(x_ND)
        probs_NE = F.softmax(logits_NE, dim=-1, dtype=torch.float32)
        weights_Nk, experts_Nk = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.routes is not None:
            experts_Nk = self.routes.route(experts_Nk, x_BSD.shape[:2], token_mask)
            weights_Nk = probs_NE.gather(1, experts_Nk)
        if self.norm_topk_prob:
            weights_Nk = weights_Nk / weights_Nk.sum(dim=-1, keepdim=True)
        weights_Nk = weights_Nk.to(x_ND.dtype)

        # Sort the (token, expert) pairs by expert so each expert's rows are contiguous for the grouped matmul;
        # the stable sort keeps each token's experts in ascending order, as transformers adds them.
        flat_experts = experts_Nk.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of_row = order // self.top_k
        counts_E = torch.bincount(flat_experts, minlength=self.num_experts)
        y = self.experts(x_ND[token_of_row], counts_E, self.ops) * weights_Nk.reshape(-1, 1)[order]
        out_ND = torch.zeros_like(x_ND).index_add_(0, token_of_row, y)
        if self.shared_expert is not None:
            out_ND = out_ND + elementwise(torch.sigmoid, self.shared_expert_gate(x_ND)) * self.shared_expert(x_ND)

        entropy_N = torch.special.entr(probs_NE.detach()).sum(dim=-1)  # -sum p ln p
        if token_mask is None:
            assigned_E = counts_E.float()
            prob_mass_E = probs_NE.sum(dim=0)
            num_tokens = torch.tensor(float(x_ND.shape[0]), device=x_ND.device)
            entropy = entropy_N.sum()
        else:
            mask_N = token_mask.reshape(-1).float()
            assigned_E = torch.zeros(self.num_experts, device=x_ND.device).index_add_(
                0, flat_experts, mask_N.repeat_interleave(self.top_k)
            )
            prob_mass_E = (probs_NE * mask_N.unsqueeze(1)).sum(dim=0)
            num_tokens = mask_N.sum()
            entropy = (entropy_N * mask_N).sum()
        return out_ND.view_as(x_BSD), (assigned_E, prob_mass_E, num_tokens, entropy)

    @torch.no_grad()
    def record_load(self, stats) -> None:
        """Add one forward's statistics (as `forward` returns them) to `load_tally`."""
        assigned_E, _, num_tokens, entropy = stats
        self.load_tally += torch.cat([assigned_E, entropy.reshape(1), num_tokens.reshape(1)])


class Routes:
    """The experts each token of one MoE layer is sent to, for a rollout and its training forward (router replay).

    Recording (`given` None): every forward's top-k expert ids are kept, [B, S, k] each, in `recorded`.
    Comparing (`given` [B, S, k] expert ids, -1 in a token's row: none): over the real tokens (token_mask),
    `changed` counts those whose experts in this forward (the ones its dispatch uses) differ as a set from the given
    ones, and `replayed` those whose router chose otherwise but were sent to the given experts. With `impose`, the
    given experts replace the top-k in the next forwards (a recompute under activation checkpointing gets the same),
    weighted by the router's probabilities of them, so the router still learns; without, the router decides.
    """

    def __init__(self, given: Optional[torch.Tensor] = None, impose: bool = True):
        self.given, self.impose = given, impose
        self.recorded = []
        self.changed = torch.zeros((), dtype=torch.long)
        self.replayed = torch.zeros((), dtype=torch.long)

    def route(self, experts_Nk: torch.Tensor, shape_BS, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if self.given is None:
            self.recorded.append(experts_Nk.view(*shape_BS, -1))
            return experts_Nk
        given_Nk = self.given.reshape(experts_Nk.shape).to(experts_Nk.device)
        use_N = (given_Nk >= 0).all(dim=-1)
        if token_mask is not None:
            use_N &= token_mask.reshape(-1).bool()
        used_Nk = torch.where(use_N[:, None], given_Nk, experts_Nk) if self.impose else experts_Nk

        def differs(a_Nk, b_Nk):
            return ((a_Nk.sort(dim=-1).values != b_Nk.sort(dim=-1).values).any(dim=-1) & use_N).sum()

        self.changed = self.changed.to(experts_Nk.device) + differs(used_Nk, given_Nk)
        self.replayed = self.replayed.to(experts_Nk.device) + (differs(experts_Nk, given_Nk) if self.impose else 0)
        return used_Nk


def moe_layers(model: nn.Module) -> list:
    """The MoE blocks of `model` (a pipeline stage: its own), in layer order."""
    return [layer.mlp for layer in model.layers.values() if layer.is_moe]


@contextlib.contextmanager
def record_routes(model: nn.Module):
    """Yields one Routes per MoE layer of `model`, recording the experts of every forward inside the block."""
    tapes = [Routes() for _ in moe_layers(model)]
    with _routes_set(model, tapes):
        yield tapes


@contextlib.contextmanager
def replay_routes(model: nn.Module, given_LBSk: torch.Tensor, impose: bool = True):
    """Forwards (and backwards) inside the block route each token to the experts `given_LBSk` [MoE layers, B, S, k]
    names; yields the Routes, whose `changed` counts the routes that still differ from `given_LBSk` (0 when every
    token was replayed) and `replayed` those that would have. With impose=False the router decides as usual and
    `changed` counts where it departs from `given_LBSk`."""
    tapes = [Routes(given, impose) for given in given_LBSk]
    with _routes_set(model, tapes):
        yield tapes


@contextlib.contextmanager
def _routes_set(model: nn.Module, tapes: list):
    layers = moe_layers(model)
    for layer, tape in zip(layers, tapes):
        layer.routes = tape
    try:
        yield
    finally:
        for layer in layers:
            layer.routes = None


def take_expert_load(model: nn.Module) -> dict:
    """{layer id: its load_tally [E + 2]} of the MoE layers `model` holds (a pipeline stage: its own), and
    the tallies start again from zero."""
    tallies = {}
    for name, layer in model.layers.items():
        if layer.is_moe:
            tallies[int(name)] = layer.mlp.load_tally.clone()
            layer.mlp.load_tally.zero_()
    return tallies


def load_figures(tally_LE2: torch.Tensor) -> dict:
    """Per-layer figures [L] from tallies [L, E + 2]: max_load (most tokens of an expert / the mean over
    experts), dead_experts (fraction of experts that got no token), router_entropy (mean over tokens, nats).
    Each is a ratio of the layer's own sums, so tallies scaled alike (counted twice by replicas) give the same."""
    assigned_LE, entropy_L, tokens_L = tally_LE2[:, :-2], tally_LE2[:, -2], tally_LE2[:, -1]
    return {"max_load": assigned_LE.max(dim=1).values / assigned_LE.mean(dim=1),
            "dead_experts": (assigned_LE == 0).float().mean(dim=1),
            "router_entropy": entropy_L / tokens_L}


def sum_stats(stats) -> list:
    """The layers' load-balancing statistics summed in layer order: [assignments_E, prob_mass_E, tokens]."""
    return [sum(s[i] for s in stats) for i in range(3)]


def pack_stats(stats, num_experts: int, device: torch.device) -> torch.Tensor:
    """The running sums of `stats` as one [3, E] tensor (rows: assignments, prob mass, tokens repeated), the
    form a pipeline stage passes on to the next beside the hidden states; zeros when `stats` is empty."""
    if not stats:
        return torch.zeros(3, num_experts, device=device)
    assigned, prob_mass, rows = sum_stats(stats)
    return torch.stack([assigned, prob_mass, rows.expand(num_experts)])


def unpack_stats(packed_3E: torch.Tensor) -> tuple:
    """pack_stats' tensor as one layer's statistics; adding the next layers to it gives the same sums, bit for
    bit, as adding all layers in one process (x + 0 is exact)."""
    return packed_3E[0], packed_3E[1], packed_3E[2, 0]


def load_balancing_loss(stats, num_experts: int, reduce=None) -> torch.Tensor:
    """Switch-Transformer aux loss over all MoE layers, exactly as transformers' load_balancing_loss_func.

    transformers averages assignments and probabilities over (layers x tokens) first and multiplies after,
    so the per-layer statistics are summed before the product. `reduce` (a tensor -> tensor sum over the
    ranks sharing the sequences, under context parallelism) makes them the whole sequences' statistics.
    """
    totals = sum_stats(stats)
    if reduce is not None:
        totals = [reduce(t) for t in totals]
    assigned, prob_mass, rows = totals
    return torch.sum((assigned / rows) * (prob_mass / rows)) * num_experts
