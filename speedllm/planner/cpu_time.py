"""A CPU's step time, measured: planning for `hardware.device=cpu` (whose peaks are this machine's probe), the
planner times the model's own forward and backward at a layout's micro-batch instead of dividing FLOPs by a peak.

At the sizes a CPU trains, FLOPs over the GEMM probe's rate miss a step by x2 either way: a step is a few thousand
eager ops on small tensors, each with its dispatch, plus attention, the loss and in bf16 the autocast casts, none
of which a GEMM's rate tells (the demo on a 2-core Xeon with AMX: the FLOP model said 0.06 s for a bf16 step of
0.14 s, and 0.35 s for an fp32 step of 0.18 s). So the planner builds the model with no decoder layer and with one
(a MoE layer for a MoE model) and times a micro-batch through each, forward and backward in the run's precision
with the op set the run uses: the difference is one layer, the first is the embedding and the output projection
with its loss. Median of 5 calls after 2 warm-up calls, measured once per machine per (model, micro-batch, dtype, op set) and
cached like the GEMM probe (speedllm.hardware.measured_once), so that a plan, and the layout parallel=auto picks
from it, is the same on every run.

Bounded, so that planning stays quick: a model whose one-layer form holds more than MAX_PARAMS parameters is not
built (the FLOP model stands), and a micro-batch of more than MAX_FLOP training FLOPs is timed at fewer sequences
(or a shorter one) and scaled by its tokens.
"""

import functools
import math
import statistics
import time
from typing import Optional, Tuple

import torch
from omegaconf import OmegaConf

from speedllm.hardware import DTYPES, measured_once
from speedllm.models import Qwen3
from speedllm.native import keep_freed_memory
from speedllm.planner.memory import model_of_key
from speedllm.train.metrics import flops_per_token

MAX_PARAMS = 150e6  # parameters of the one-layer model built to be timed (qwen3_0.6b's: 171M -> not timed)
MAX_FLOP = 20e9  # training FLOPs of one timed call (~0.1 s at a 2-core CPU's fp32 rate)
WARMUP, CALLS = 2, 5


@functools.cache
def layer_and_rest_seconds(key: tuple, batch: int, seq_len: int, dtype: str, ops: str) -> Optional[Tuple[float, float]]:
    """(one decoder layer, the rest: embedding, final norm, output projection and loss) in seconds of forward and
    backward of `batch` sequences of `seq_len` tokens, for the model of config_key `key` on this CPU; None where it
    is too big to build here."""
    cfg = model_of_key(key)
    moe = cfg.num_experts > 0
    one = OmegaConf.merge(cfg, {"num_hidden_layers": 1, **({"mlp_only_layers": [], "decoder_sparse_step": 1} if moe
                                                            else {})})
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3(one).parameters())
    if params > MAX_PARAMS:
        return None
    rows, seq = batch, seq_len
    while rows * seq * flops_per_token(one, seq) > MAX_FLOP and (rows > 1 or seq > 16):
        rows, seq = (rows // 2, seq) if rows > 1 else (rows, seq // 2)
    scale = batch * seq_len / (rows * seq)

    def measure() -> list:
        keep_freed_memory()  # as the training runtime has it (speedllm.runtime)
        rest = _seconds(OmegaConf.merge(one, {"num_hidden_layers": 0}), rows, seq, dtype, ops)
        return [max(0.0, _seconds(one, rows, seq, dtype, ops) - rest), rest]

    layer, rest = measured_once("plan", measure, detail=f"{key}|{rows}|{seq}|{dtype}|{ops}", valid=_two_times)
    return layer * scale, rest * scale


def _two_times(value) -> bool:
    """A cached (layer, rest): two finite seconds, the rest's above zero."""
    return isinstance(value, list) and len(value) == 2 and all(
        isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in value) and value[1] > 0


def _seconds(cfg, rows: int, seq: int, dtype: str, ops: str) -> float:
    """Median seconds of forward + backward (and setting the gradients free, as a step's zero_grad) of a random
    micro-batch through the model `cfg` in fp32 weights, under autocast for a lower `dtype`."""
    torch.manual_seed(0)
    model = Qwen3(cfg, ops=ops).train()
    model.init_weights()  # the constructor leaves them unset (denormal garbage would be slow)
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq))

    def call() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=DTYPES[dtype], enabled=dtype != "float32"):
            ce_sum, aux = model(tokens, labels=tokens)
        (ce_sum / tokens.numel() + aux).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times = [call() for _ in range(WARMUP + CALLS)][WARMUP:]
    return statistics.median(times)
