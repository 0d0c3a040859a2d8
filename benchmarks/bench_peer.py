"""Training step and decode speed against the strongest peers: ours vs torchtitan vs transformers, side by side.

    python -m benchmarks peer [--steps 7] [--configs vocab_32k qwen3_vocab moe_60m] [--dtype bfloat16] [--decode]
                              [--compile] [--dry]

The same ~42M-parameter Qwen3 (benchmarks/common.py's two configs: `vocab_32k`, 8 layers x 512 at vocab 32,000, and
`qwen3_vocab`, qwen3_tiny's layers at the real 151,936 vocabulary), batch 4 x 256, fp32, tied embeddings.
`moe_60m` is a 60.5M-parameter Qwen3-MoE (vocab_32k's attention, every layer 8 experts of 384, top-2,
normalized top-k weights; 32M parameters activated per token): transformers' Qwen3MoeForCausalLM against
torchtitan's Qwen3 MoE layers (`_build_qwen3_moe_layers`: its router and grouped experts on torch._grouped_mm;
no load-balancing bias, and its experts' casts to bf16 taken out: common._grouped_experts_fp32) and ours, which
also computes its load-balancing loss (router_aux_loss_coef 0.001); transformers' as it ships has none
(output_router_logits=False).
transformers' random weights are loaded into all systems, and their logits are checked equal before any
timing. A training step is forward + backward + gradient clipping + AdamW, each system as it ships:
  ours                   speedllm's Qwen3 with its defaults (loss path, optimizer and clipping of `task=pretrain`,
                         op set of `hardware=cpu`: the fused CPU kernels)
  torchtitan             torchtitan 0.3.0's Qwen3 (fused q/k/v, nn.RMSNorm, fused AdamW, its clip_grad_norm_) with
                         plain cross-entropy over the full logits; its flex/varlen attention cannot train on CPU,
                         so its SDPA module stands in
  torchtitan_chunked     the same with its ChunkedLossWrapper recipe (8 chunks)
  transformers           Qwen3ForCausalLM(labels=...) with torch's AdamW (foreach) and clip_grad_norm_
  ours_reference         ours with the reference op set (what the fused CPU kernels gain; only when asked for)
  ours_float32           ours in fp32 whatever --dtype (with --dtype bfloat16: bf16's gain in one interleaved run;
                         only when asked for)
torchtitan is an optional dependency (`pip install -e ".[bench]"`); without it its rows are skipped with a
message. Steps are interleaved (system by system within each step), so load from other processes hits all
alike; the median and the fastest step are reported. Peak memory: each system runs two training steps alone in
a fresh process, which reports its peak RSS (VmHWM, including ~0.3 GB of Python/torch runtime).
--decode: greedy decode tokens/s at batch 1 and 8, ours vs transformers' `generate` with its static cache.
--compile: the step again with torch.compile on the decoder layers (ours: `train.compile`; torchtitan: its
per-block compile), with the start-up beside the compiled speed: the wall time of the first compiled step of
each system alone in a fresh process with an empty compile cache.
--dtype bfloat16: every system trains in bf16 mixed precision, each by its own setting, which on one CPU device
is torch.autocast over fp32 weights and optimizer states for all three: ours `hardware.dtype=bfloat16`
(speedllm.train.build.autocast_for), torchtitan `mixed_precision_param = "bfloat16"` without FSDP
(torchtitan.distributed.utils.maybe_enable_amp), transformers' Trainer `bf16=True` (its amp autocast). The logits
check stays fp32; decoding stays fp32.
--dry: one step and a short decode of the `tiny` config.
"""

import argparse
import json
import statistics
import tempfile

import torch
from omegaconf import OmegaConf

from benchmarks.common import (BATCH, CLOCKS, CONFIGS, SEQ, batch, decode_speed, have_torchtitan, in_fresh_process,
                               interleaved, make_parser, model_cfg, parse, timed, torchtitan_model)
from speedllm.config.schema import AdamWConfig
from speedllm.models import Qwen3
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config
from speedllm.native import keep_freed_memory
from speedllm.parallel import ParallelModel, clip_grad_norm
from speedllm.paths import CONF
from speedllm.train.metrics import peak_memory_gb
from speedllm.train.optimizer import build_optimizer

SYSTEMS = ("ours", "torchtitan", "torchtitan_chunked", "transformers", "ours_reference", "ours_float32")
OPS = OmegaConf.load(CONF / "hardware" / "cpu.yaml").ops  # ours runs the op set `hardware=cpu` runs
GRAD_CLIP = 1.0
OPTIM = OmegaConf.structured(AdamWConfig)  # our defaults; the peers get the same lr, betas, eps, decay


def hf_model(config: str):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    cfg = model_cfg(config)
    torch.manual_seed(0)
    return (Qwen3MoeForCausalLM if cfg.num_experts else Qwen3ForCausalLM)(hf_config(cfg))


def build(name: str, config: str, hf=None, dtype: str = "float32"):
    """(model, step function) for one system; `hf` (transformers' model) supplies the weights; dtype bfloat16:
    forward and backward under torch.autocast (each system's own bf16 setting on one CPU device)."""
    hf = hf if hf is not None else hf_model(config)
    dtype = "float32" if name == "ours_float32" else dtype
    tokens, labels = batch(hf.config.vocab_size)
    num_labels = (labels != -100).sum()
    if name == "transformers":
        model = hf.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=tuple(OPTIM.betas), eps=OPTIM.eps,
                                      weight_decay=OPTIM.weight_decay, foreach=True)

        def forward_backward():
            model(tokens, labels=tokens).loss.backward()

        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP, foreach=True)
    elif name.startswith("ours"):
        cfg = model_cfg(config)
        model = Qwen3(cfg, ops="reference" if name == "ours_reference" else OPS).train()
        model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
        optimizer = build_optimizer(model, OPTIM)

        def forward_backward():
            ce_sum, aux = model(tokens, labels=labels)
            (ce_sum / num_labels + aux).backward()

        def clip():
            clip_grad_norm(ParallelModel(model, [model]), GRAD_CLIP)
    else:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.distributed.utils import clip_grad_norm_

        model = torchtitan_model(model_cfg(config), hf.state_dict(), SEQ).train()
        # torchtitan's default: fused AdamW, one group, decay on everything
        optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=tuple(OPTIM.betas), eps=OPTIM.eps,
                                      weight_decay=OPTIM.weight_decay, fused=True)
        if name == "torchtitan_chunked":
            loss_fn = ChunkedLossWrapper.Config().build()
            loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        else:
            loss_fn = CrossEntropyLoss.Config().build()

        def forward_backward():
            loss, _ = loss_fn(model(tokens), labels, num_labels)
            loss.backward()

        def clip():
            clip_grad_norm_(model.parameters(), GRAD_CLIP, foreach=True)

    ours = name.startswith("ours")

    def step():
        keep_freed_memory(ours)  # each system's allocator as it ships: ours keeps freed memory (speedllm.runtime)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            forward_backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def logits_of(name: str, model, tokens) -> torch.Tensor:
    with torch.no_grad():
        if name == "transformers":
            return model(tokens).logits
        if name == "torchtitan_chunked":
            return model.lm_head(model(tokens))
        return model(tokens)


def check_logits(models: dict, hf) -> float:
    """Largest logit difference of every system from transformers' model `hf` (asserted within fp32 tolerance),
    whether or not transformers is among the timed systems."""
    tokens, _ = batch(hf.config.vocab_size)
    ref = logits_of("transformers", hf, tokens)
    worst = 0.0
    for name, model in models.items():
        got = logits_of(name, model, tokens)
        torch.testing.assert_close(got, ref, msg=lambda m: f"{name} logits differ from transformers': {m}")
        worst = max(worst, (got - ref).abs().max().item())
    return worst


def compile_layers(name: str, model) -> None:
    """What each system's own compile switch does: ours and torchtitan compile each decoder layer."""
    if name == "transformers":
        model.compile()
        return
    for layer in model.layers.values():
        layer.compile()


def bench_training(config: str, systems, steps: int, compile_: bool, clock, dtype: str = "float32") -> dict:
    hf = hf_model(config)
    runs = {name: build(name, config, hf, dtype) for name in systems}
    max_diff = check_logits({name: model for name, (model, _) in runs.items()}, hf)
    if compile_:
        for name, (model, step) in runs.items():
            compile_layers(name, model)
            step()  # compiles; the start-up is timed in a fresh process (child)
    # the first round warms up and is not timed
    times, _ = interleaved({name: step for name, (_, step) in runs.items()}, steps, clock, warmup=1)
    del runs, hf
    result = {"max_logit_diff": max_diff, "systems": {}}
    for name, t in times.items():
        row = {"median_tokens_per_s": BATCH * SEQ / statistics.median(t), "best_tokens_per_s": BATCH * SEQ / min(t)}
        result["systems"][name] = row | child(name, config, compile_, dtype)
    return result


GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm")


def profile(config: str, systems, rows: int, dtype: str = "float32") -> None:
    """torch.profiler table of one training step per system (after one untimed step), by self CPU time, and the
    step's GEMM share: the self time of the matrix-multiply ops over the profiled step's wall time."""
    hf = hf_model(config)
    for name in systems:
        _, step = build(name, config, hf, dtype)
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            seconds, _ = timed(step)
        events = prof.key_averages()
        gemm_s = sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / 1e6
        print(f"\n{config} {name}: step {seconds:.3f} s, GEMMs {gemm_s:.3f} s = {gemm_s / seconds:.1%} of it")
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows))


def child(name: str, config: str, compile_: bool, dtype: str) -> dict:
    """One system alone in a fresh process with an empty compile cache (run_child): {"peak_rss_gb"}, or with
    compile_ {"compile_s"}."""
    with tempfile.TemporaryDirectory() as cache:
        return in_fresh_process(__name__, "--child", name, "--configs", config, "--dtype", dtype,
                                *["--compile"] * compile_, env={"TORCHINDUCTOR_CACHE_DIR": cache})


def run_child(name: str, config: str, compile_: bool, dtype: str) -> None:
    """Print as JSON the peak RSS in GB of two training steps, or with compile_ the wall time of the first
    compiled step (compilation, its compiler subprocesses included, plus one step) from a cold cache."""
    model, step = build(name, config, dtype=dtype)
    if compile_:
        compile_layers(name, model)
        print(json.dumps({"compile_s": timed(step)[0]}))
        return
    step()
    step()
    print(json.dumps({"peak_rss_gb": peak_memory_gb(torch.device("cpu"))}))


def print_training(config: str, result: dict, compile_: bool, dtype: str) -> None:
    rows = result["systems"]
    precision = "fp32" if dtype == "float32" else "bf16 autocast over fp32 weights"
    print(f"\n{config}: {CONFIGS[config]['vocab_size']} vocab, batch {BATCH}x{SEQ}, {precision}, "
          f"{torch.get_num_threads()} threads{', torch.compile' if compile_ else ''}; "
          f"logits equal to transformers' (max |diff| {result['max_logit_diff']:.1e})")
    extra = "compile start-up s" if compile_ else "peak RSS GB"
    print(f"| system | tokens/s (median) | tokens/s (best) | {extra} |\n|---|---|---|---|")
    for name, row in rows.items():
        value = row["compile_s"] if compile_ else row["peak_rss_gb"]
        print(f"| {name} | {row['median_tokens_per_s']:.1f} | {row['best_tokens_per_s']:.1f} | {value:.2f} |")
    ours = rows["ours"]
    for name in rows:
        if name == "ours":
            continue
        line = (f"ours / {name}: tokens/s x{ours['median_tokens_per_s'] / rows[name]['median_tokens_per_s']:.2f} "
                f"(median), x{ours['best_tokens_per_s'] / rows[name]['best_tokens_per_s']:.2f} (best)")
        if not compile_:
            line += f", peak memory x{ours['peak_rss_gb'] / rows[name]['peak_rss_gb']:.2f}"
        print(line)


def bench_decode(config: str, new_tokens: int, repeats: int, clock) -> list:
    """Decode at batch 1 and 8 on the `config` model, fp32: [(batch, tokens/s by system, same ids)]."""
    cfg = model_cfg(config)
    hf = hf_model(config).eval()
    ours = Qwen3(cfg, ops=OPS).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch_size in (1, 8):
        prompt = torch.randint(0, cfg.vocab_size, (batch_size, 16), generator=gen)
        rows.append((batch_size, *decode_speed(ours, hf, prompt, new_tokens, repeats, torch.float32, clock)))
    return rows


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["vocab_32k", "qwen3_vocab"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:4]))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="training precision of every system (bfloat16: each one's mixed precision)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd steps")
    parser.add_argument("--decode", action="store_true", help="also time greedy decoding against transformers")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="cpu: this process's CPU time (use with --threads 1 on a machine shared with other jobs)")
    parser.add_argument("--profile", type=int, metavar="ROWS", help="print a profiler table per system instead")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parse(parser, argv, steps=1, configs=["tiny"], decode=True, new_tokens=4)
    if args.child:
        run_child(args.child, args.configs[0], args.compile, args.dtype)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    titan = have_torchtitan()
    systems = [s for s in args.systems if titan or not s.startswith("torchtitan")]
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[0]} on {torch.get_num_threads()} threads")
    clock = CLOCKS[args.clock]
    for config in args.configs:
        if args.profile:
            profile(config, systems, args.profile, args.dtype)
            continue
        print_training(config, bench_training(config, systems, args.steps, False, clock, args.dtype), False,
                       args.dtype)
        if args.compile:
            print_training(config, bench_training(config, systems, args.steps, True, clock, args.dtype), True,
                           args.dtype)
    if args.decode:
        config = "tiny" if args.dry else "vocab_32k"
        print(f"\ndecode ({config}, fp32, greedy, {args.new_tokens} new tokens, median of 3, prefill subtracted)")
        print("| batch | transformers static cache tokens/s | ours tokens/s | ratio | same ids |\n|---|---|---|---|---|")
        for batch_size, decode, same in bench_decode(config, args.new_tokens, 3, clock):
            print(f"| {batch_size} | {decode['transformers']:.1f} | {decode['ours']:.1f} | "
                  f"x{decode['ours'] / decode['transformers']:.2f} | {same} |")
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[0]}")
