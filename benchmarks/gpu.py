"""GPU benchmark: the `cuda` op set against `reference`, bf16 training steps of qwen3_0.6b and qwen3_1.7b (ours vs
torchtitan), float8, and decoding, in one run that writes one table.

    python -m benchmarks gpu                      # on a CUDA machine (sized for < 8 min on one H200): gpu_results.md
    python -m benchmarks gpu --dry --out t.md     # CPU: the same code path on tiny models (tests/test_benchmarks.py)

Sections (each row of the table says what it measured):
  ops       max |cuda - reference| per op at qwen3_0.6b's sizes, in fp32 and bf16 (attention against the
            written-out formula `reference.attention_math`), then `pytest tests/test_ops.py` on this device.
  train     one training step as `task=pretrain` takes it (bf16 autocast over fp32 weights, chunked loss, clipping,
            fused AdamW), batch 4 x 2048, median of 10 steps after 3: tokens/s, MFU against the hardware
            profile's bf16 peak (h200 / h100 / cuda by device name), peak allocated memory, and the first loss.
            torchtitan 0.3.0 (if installed: `pip install -e ".[bench]"`) on the same weights, its Qwen3 with
            plain cross-entropy and fused AdamW, as in `python -m benchmarks peer`.
  compiled  qwen3_0.6b with its decoder layers compiled (`train.compile`), in bf16 and, when torchao's float8
            training and an sm89+ GPU are there, with float8 linears in the decoder layers; compile time beside.
  decode    greedy decode tokens/s of qwen3_0.6b in bf16 at batch 1 and 8, ours vs transformers' static-cache
            `generate` on the same weights.
  offload   qwen3_1.7b trained on one GPU through `launch.py` as a user runs it (batch 4 x 2048, 12 steps), without
            offload and with each lever of docs/offload.md: step time of the last 6 steps, peak allocated device
            memory (train/metrics.py's peak_mem_gb) and the loss of the first 6 steps (the same for every lever).
Rows are written as they finish, so a run cut short still leaves its table; --budget-s skips what would not fit.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import CONFIGS, REPO, decode_speed, have_torchtitan, make_parser, parse, torchtitan_model
from speedllm.config.schema import AdamWConfig
from speedllm.hardware import cpu_peaks
from speedllm.models import Qwen3
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import hf_config, to_hf_state_dict
from speedllm.ops import get_ops, reference
from speedllm.parallel import ParallelModel, clip_grad_norm
from speedllm.paths import CONF
from speedllm.train.metrics import flops_per_token, mfu
from speedllm.train.optimizer import build_optimizer

MODELS = ("qwen3_0.6b", "qwen3_1.7b")
TINY = CONFIGS["tiny"]  # --dry: every model shrunk to this


class Table:
    """Markdown rows, appended to the output file as they come."""

    def __init__(self, path: Path, header: str):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{header}\n\n| section | what | ours | torchtitan | transformers | notes |\n"
                        "|---|---|---|---|---|---|\n")

    def row(self, *cells) -> None:
        line = "| " + " | ".join(str(c) for c in cells) + " |"
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def model_cfg(name: str, dry: bool):
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / f"{name}.yaml"),
                          {"tokenizer": "unused"})
    return OmegaConf.merge(cfg, TINY) if dry else cfg


def peak_tflops_bf16(device: torch.device) -> float:
    if device.type == "cpu":
        return cpu_peaks()["bfloat16"]  # this CPU's measured peak (conf/hardware/cpu.yaml reads the same probe)
    name = torch.cuda.get_device_name(device).lower()
    profile = "h200" if "h200" in name else "h100" if "h100" in name else "cuda"
    return OmegaConf.load(CONF / "hardware" / f"{profile}.yaml").peak_tflops.bfloat16


def ops_for(device: torch.device) -> str:
    """The op set the hardware profiles give this device (cuda / cpu)."""
    return "cuda" if device.type == "cuda" else "reference"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def ops_rows(table: Table, device: torch.device, dry: bool) -> None:
    """Each op of the cuda set against reference on the same inputs, at qwen3_0.6b's sizes (or tiny ones)."""
    cuda = get_ops("cuda")
    B, S, H, K, Dh, D, V = (1, 64, 4, 2, 16, 64, 512) if dry else (2, 2048, 16, 8, 128, 1024, 151936)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    for dtype in (torch.float32, torch.bfloat16):
        x, w = rand(B, S, D, dtype=dtype), rand(D, dtype=dtype)
        q, k, v = rand(B, H, S, Dh, dtype=dtype), rand(B, K, S, Dh, dtype=dtype), rand(B, K, S, Dh, dtype=dtype)
        cos, sin = rand(B, S, Dh, dtype=dtype), rand(B, S, Dh, dtype=dtype)
        gate, up = rand(B * S, 3 * D, dtype=dtype), rand(B * S, 3 * D, dtype=dtype)
        logits, labels = rand(B * S, V, dtype=dtype), torch.randint(0, V, (B * S,), generator=gen, device=device)
        diffs = {
            "rms_norm": max_diff(cuda.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)),
            "rotary": max_diff(cuda.rotary(q.transpose(1, 2), cos, sin), reference.rotary(q.transpose(1, 2), cos, sin)),
            "swiglu": max_diff(cuda.swiglu(gate, up), reference.swiglu(gate, up)),
            "attention (causal)": max_diff(cuda.attention(q, k, v, None, Dh**-0.5),
                                           reference.attention_math(q.float(), k.float(), v.float(), None, Dh**-0.5)),
            "cross_entropy (sum)": abs(cuda.cross_entropy(logits, labels) - reference.cross_entropy(logits, labels))
            .item() / (B * S),
        }
        if dtype == torch.bfloat16:  # torch's grouped GEMM takes bf16
            counts = torch.tensor([S // 2, 0, B * S - S // 2 - 1, 1], device=device)
            xs, ws = rand(B * S, D, dtype=dtype), rand(4, 3 * D // 4, D, dtype=dtype)
            diffs["grouped_mm"] = max_diff(cuda.grouped_mm(xs, ws, counts), reference.grouped_mm(xs, ws, counts))
        for op, diff in diffs.items():
            note = "per token" if op.startswith("cross") else "vs the fp32 formula" if op.startswith("att") else ""
            table.row("ops", f"{op}, {str(dtype).removeprefix('torch.')}: max abs diff cuda vs reference",
                      f"{diff:.2e}", "-", "-", note)
    if not dry:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(REPO / "tests/test_ops.py")]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO).stdout.strip().splitlines()
        table.row("ops", "pytest tests/test_ops.py on this device (cuda set vs reference)", out[-1] if out else "?",
                  "-", "-", "")


def training_step(system: str, cfg, device, batch: int, seq: int, compile_: bool = False, float8: bool = False):
    """(step function returning the loss, model); ours is built and initialized on `device` (seed 0), torchtitan
    takes its weights."""
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen, device=device)
    tokens, labels = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    optim = OmegaConf.structured(AdamWConfig)
    with device:
        ours = Qwen3(cfg, ops=ops_for(device))
    ours.init_weights(seed=0)
    if system == "ours":
        model = ours
        if float8:
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn.startswith("layers."))
        if compile_:  # --dry: TorchDynamo's tracing without code generation, to keep the check quick
            for layer in model.layers.values():
                layer.compile(backend="eager" if device.type == "cpu" else "inductor")
        optimizer = build_optimizer(model, optim)

        def loss_backward():
            with autocast:
                ce_sum, aux = model(tokens, labels=labels)
            loss = ce_sum / labels.numel() + aux
            loss.backward()
            return loss

        def clip():
            clip_grad_norm(ParallelModel(model, [model]), 1.0)
    else:
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.distributed.utils import clip_grad_norm_

        hf_sd = to_hf_state_dict(ours.state_dict(), cfg)
        with device:
            model = torchtitan_model(cfg, hf_sd, seq).train()
        del ours, hf_sd
        optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                      weight_decay=optim.weight_decay, fused=True)
        loss_fn = CrossEntropyLoss.Config().build()

        def loss_backward():
            with autocast:
                loss, _ = loss_fn(model(tokens), labels, labels.numel())
            loss.backward()
            return loss

        def clip():
            clip_grad_norm_(model.parameters(), 1.0, foreach=True)

    def step():
        loss = loss_backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, model


def train_rows(table: Table, device, dry: bool, systems, deadline: float) -> None:
    batch, seq, warmup, steps = (2, 32, 1, 3) if dry else (4, 2048, 3, 10)
    peak = peak_tflops_bf16(device)
    variants = [(name, False, False) for name in MODELS]
    variants += [("qwen3_0.6b", True, False), ("qwen3_0.6b", True, True)]
    for name, compile_, float8 in variants:
        cfg = model_cfg(name, dry)
        label = f"{name}, {batch}x{seq}, bf16" + (" float8" if float8 else "") + (", compiled layers" if compile_ else "")
        section = "compiled" if compile_ else "train"
        if float8 and not float8_available(device):
            table.row(section, label, "skipped", "-", "-", "needs torchao float8 and an sm89+ GPU")
            continue
        cells, notes = {}, []
        for system in (["ours"] if compile_ else systems):
            if time.monotonic() > deadline:
                cells[system] = "skipped (time budget)"
                continue
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step, model = training_step(system, cfg, device, batch, seq, compile_, float8)
            start = time.perf_counter()
            first_loss = step()
            first_s = time.perf_counter() - start
            for _ in range(warmup - 1):
                step()
            times = []
            for _ in range(steps):
                sync(device)
                start = time.perf_counter()
                step()
                sync(device)
                times.append(time.perf_counter() - start)
            tokens_per_s = batch * seq / statistics.median(times)
            util = mfu(tokens_per_s, flops_per_token(cfg, seq), peak, 1)
            memory = f", {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GB" if device.type == "cuda" else ""
            cells[system] = f"{tokens_per_s:,.0f} tok/s, MFU {util:.1%}{memory}, loss {first_loss:.4f}"
            if compile_:
                notes.append(f"first step (compiling) {first_s:.0f} s")
            del step, model
        table.row(section, label, cells.get("ours", "-"), cells.get("torchtitan", "-"), "-", "; ".join(notes))


def float8_available(device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def decode_rows(table: Table, device, dry: bool, deadline: float) -> None:
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg("qwen3_0.6b", dry)
    dtype = torch.float32 if dry else torch.bfloat16  # fp32 on CPU: the same ids are then expected
    new_tokens = 8 if dry else 64
    with device:
        ours = Qwen3(cfg, ops=ops_for(device))
    ours.init_weights(seed=0)
    ours = ours.to(dtype).eval()
    with device:
        hf = Qwen3ForCausalLM(hf_config(cfg)).to(dtype).eval()
    hf_sd = to_hf_state_dict(ours.state_dict(), cfg)
    hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"]  # tied: an HF checkpoint leaves it out
    hf.load_state_dict(hf_sd)
    for batch in (1, 8):
        if time.monotonic() > deadline:
            table.row("decode", f"batch {batch}", "skipped (time budget)", "-", "-", "")
            continue
        prompt = torch.randint(0, cfg.vocab_size, (batch, 16), device=device)
        speed, same = decode_speed(ours, hf, prompt, new_tokens, 3, dtype)
        table.row("decode", f"qwen3_0.6b, {str(dtype).removeprefix('torch.')}, batch {batch}, {new_tokens} new tokens",
                  f"{speed['ours']:,.1f} tok/s", "-", f"{speed['transformers']:,.1f} tok/s",
                  f"x{speed['ours'] / speed['transformers']:.2f}, same ids: {same}")


OFFLOAD_LEVERS = {"no offload": [], "parallel.offload=optimizer": ["parallel.offload=optimizer"],
                  "parallel.offload=params": ["parallel.offload=params"],
                  "train.activation_offload=true": ["train.activation_offload=true"]}


def offload_rows(table: Table, dry: bool, deadline: float) -> None:
    """Each offload lever against none: a short training run through launch.py on one device, read back from
    its metrics.jsonl (the second logging window: steps after the first, compiled and warmed up)."""
    seq, batch, steps = (32, 2, 4) if dry else (2048, 4, 12)
    # on a CPU in fp32: the levers' losses are compared exactly (auto would pick bf16 on an AMX CPU)
    model = ["model=qwen3_tiny", "model.num_hidden_layers=2", "hardware=cpu", "hardware.dtype=float32"] if dry \
        else ["model=qwen3_1.7b"]
    run = [*model, f"train.seq_len={seq}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
           f"train.steps={steps}", f"train.log_every={steps // 2}", "train.eval_every=0", "checkpoint.save_final=false",
           "generate.num_samples=0", "logging.tensorboard=false", "logging.progress_bar=false"]
    baseline = None
    for label, lever in OFFLOAD_LEVERS.items():
        what = f"{model[0].split('=')[1]}, {batch}x{seq}, 1 device, {label}"
        if time.monotonic() > deadline:
            table.row("offload", what, "skipped (time budget)", "-", "-", "")
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            proc = subprocess.run([sys.executable, str(REPO / "launch.py"), f"hydra.run.dir={run_dir}", *run, *lever],
                                  capture_output=True, text=True, cwd=run_dir)
            if proc.returncode != 0:
                table.row("offload", what, "failed", "-", "-", proc.stderr.strip().splitlines()[-1][:200])
                continue
            first, last = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        step_s = batch * seq / last["tokens_per_s"]
        baseline = baseline or (step_s, last["peak_mem_gb"])
        table.row("offload", what, f"{step_s:.3f} s/step, {last['peak_mem_gb']:.2f} GB peak", "-", "-",
                  f"loss {first['loss']:.5f}; x{step_s / baseline[0]:.2f} time, "
                  f"x{last['peak_mem_gb'] / baseline[1]:.2f} memory of no offload")


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--out", default="gpu_results.md")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip sections that start after this")
    args = parse(parser, argv)  # --dry: CPU, tiny models, the same code path
    start = time.monotonic()
    deadline = start + args.budget_s
    if args.dry:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("no CUDA device: run on a GPU machine, or with --dry to check the script on CPU")
    systems = ["ours", "torchtitan"] if have_torchtitan() else ["ours"]
    what = "CPU dry run (tiny models)" if args.dry else torch.cuda.get_device_name(device)
    table = Table(Path(args.out), f"python -m benchmarks gpu on {what}, torch {torch.__version__}, "
                                  f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows stay fp32
    with torch.no_grad():
        ops_rows(table, device, args.dry)
    train_rows(table, device, args.dry, systems, deadline)
    decode_rows(table, device, args.dry, deadline)
    offload_rows(table, args.dry, deadline)
    table.row("total", "wall time of this run", f"{time.monotonic() - start:.0f} s", "-", "-",
              f"table in {os.path.abspath(args.out)}")
