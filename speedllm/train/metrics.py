"""Throughput accounting (MFU, peak memory) and the rank-0 metric sinks; FLOPs per token are the model's
(speedllm.models.flops, imported here for the loop)."""

import json
import resource
import sys
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from speedllm.models.flops import flops_per_token, matmul_params_per_token  # noqa: F401 (the loop's and tests' names)
from speedllm.models.moe import load_figures, take_expert_load
from speedllm.models.qwen3 import is_moe_layer
from speedllm.storage import write_text_atomic


def peak_devices(cfg, world_size: int) -> int:
    """How many times hardware.peak_tflops the ranks have: one per rank on accelerators; on CPUs one per node, as
    a node's ranks share the cores its probe measured (the probe runs at the launcher's thread count)."""
    return cfg.launcher.nnodes if cfg.hardware.device == "cpu" else world_size


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops: float, world_size: int) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the summed peak of all devices."""
    return tokens_per_s * flops_per_tok / (peak_tflops * 1e12 * world_size)


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocator peak on GPU/NPU, peak resident set size on CPU.

    On Linux the RSS peak is /proc's VmHWM, which starts afresh at exec; ru_maxrss would carry over the
    parent's resident size at fork, so a small child of a large parent would report the parent's size.
    """
    if device.type == "cpu":
        try:
            with open("/proc/self/status") as status:
                kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return kb / 2**20
    return getattr(torch, device.type).max_memory_allocated(device) / 2**30


def expert_load_metrics(module: nn.Module, model: DictConfig, device: torch.device) -> Dict[str, float]:
    """`moe/layer_<i>/{max_load,dead_experts,router_entropy}` of every MoE layer and the whole model's
    `moe/max_load` (max over layers), `moe/dead_experts` and `moe/router_entropy` (means over layers), over the
    training forwards since the last call, on this rank's `module` (docs/moe-metrics.md).

    The tallies are summed over all ranks (a collective: every rank calls this): the dp and cp ranks' tokens
    and ep ranks' routers add up to the global batch, pipeline ranks contribute their own layers, and tensor
    parallel replicas scale a layer's sums alike, which its ratios do not see.
    """
    table_LE2 = torch.zeros(model.num_hidden_layers, model.num_experts + 2, device=device)
    for layer, tally in take_expert_load(module).items():
        table_LE2[layer] = tally
    if dist.is_initialized():
        dist.all_reduce(table_LE2)
    layers = [i for i in range(model.num_hidden_layers) if is_moe_layer(model, i)]
    figures = {name: values.tolist() for name, values in load_figures(table_LE2[layers]).items()}
    metrics = {"moe/max_load": max(figures["max_load"]),
               "moe/dead_experts": sum(figures["dead_experts"]) / len(layers),
               "moe/router_entropy": sum(figures["router_entropy"]) / len(layers)}
    for name, values in figures.items():
        metrics |= {f"moe/layer_{i}/{name}": value for i, value in zip(layers, values)}
    return metrics


def tensorboard_tag(prefix: str, name: str) -> str:
    """`<prefix>/<name>`, or for a name with its own group (`moe/layer_3/max_load`) that group with slashes
    made underscores (`moe_layer_3/max_load`): TensorBoard groups scalars by the tag's first component."""
    if "/" not in name:
        return f"{prefix}/{name}"
    group, leaf = name.rsplit("/", 1)
    return f"{group.replace('/', '_')}/{leaf}"


class MetricsLogger:
    """Rank 0's sinks: `metrics.jsonl`, TensorBoard event files and a console progress bar with ETA (on a
    terminal only: redirected, every redraw would be a line of the log; the `[train] step` lines carry the figures).

    Construct it on every rank; only the main rank writes anything.
    """

    def __init__(self, run_dir: str, total_steps: int, start_step: int, enabled: bool,
                 tensorboard: bool = True, progress_bar: bool = True):
        self.enabled = enabled
        self.jsonl = self.writer = self.bar = None
        if not enabled:
            return
        run_path = Path(run_dir)
        run_path.mkdir(parents=True, exist_ok=True)
        path = run_path / "metrics.jsonl"
        if path.is_file():  # a resumed run redoes the steps after its checkpoint: their earlier rows go
            rows = path.read_text().splitlines(keepends=True)
            write_text_atomic(path, "".join(r for r in rows if json.loads(r)["step"] <= start_step), "run_dir")
        self.jsonl = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(run_path / "tensorboard"))
        if progress_bar and sys.stderr.isatty():  # a file, CI or SLURM log gets the periodic lines only
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def log(self, step: int, metrics: Dict[str, float], prefix: str = "train") -> None:
        """Write one record: a jsonl line `{"step", **metrics}` and `<prefix>/<name>` scalars."""
        if not self.enabled:
            return
        record = {"step": step, **({} if prefix == "train" else {"split": prefix}), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(tensorboard_tag(prefix, name), value, step)
            self.writer.flush()
        if self.bar is not None:
            shown = {k: metrics[k] for k in ("loss", "lr", "tokens_per_s", "mfu") if k in metrics}
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        self.message(f"[{prefix}] step {step} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def message(self, text: str) -> None:
        """A line on the console of the main rank, without breaking the progress bar."""
        if self.enabled:
            (self.bar.write if self.bar is not None else print)(text)

    def advance(self, step: int) -> None:
        """Move the progress bar to `step` (finished steps)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
