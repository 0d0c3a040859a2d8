"""Training step and decode speed against the strongest peers: ours vs torchtitan vs transformers, side by side.

    python benchmarks/bench_peer.py [--steps 7] [--configs vocab_32k qwen3_vocab] [--decode] [--compile]

The same ~42M-parameter Qwen3 (bench_model's two configs: `vocab_32k`, 8 layers x 512 at vocab 32,000, and
`qwen3_vocab`, qwen3_tiny's layers at the real 151,936 vocabulary), batch 4 x 256, fp32, tied embeddings.
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
torchtitan is an optional dependency (`pip install -e ".[bench]"`); without it its rows are skipped with a
message. Steps are interleaved (system by system within each step), so load from other processes hits all
alike; the median and the fastest step are reported. Peak memory: each system runs two training steps alone in
a fresh process, which reports its peak RSS (VmHWM, including ~0.3 GB of Python/torch runtime).
--decode: greedy decode tokens/s at batch 1 and 8, ours vs transformers' `generate` with its static cache.
--compile: the step again with torch.compile on the decoder layers (ours: `train.compile`; torchtitan: its
per-block compile), with the start-up beside the compiled speed: the wall time of the first compiled step of
each system alone in a fresh process with an empty compile cache.
"""

import argparse
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import BATCH, CONFIGS, SEQ, model_cfg  # noqa: E402

from speedllm.config.schema import AdamWConfig  # noqa: E402
from speedllm.models import Qwen3  # noqa: E402
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config  # noqa: E402
from speedllm.parallel import ParallelModel, clip_grad_norm  # noqa: E402
from speedllm.paths import CONF  # noqa: E402
from speedllm.train.metrics import peak_memory_gb  # noqa: E402
from speedllm.train.optimizer import build_optimizer  # noqa: E402

SYSTEMS = ("ours", "torchtitan", "torchtitan_chunked", "transformers", "ours_reference")
OPS = OmegaConf.load(CONF / "hardware" / "cpu.yaml").ops  # ours runs the op set `hardware=cpu` runs
GRAD_CLIP = 1.0
OPTIM = OmegaConf.structured(AdamWConfig)  # our defaults; the peers get the same lr, betas, eps, decay


def have_torchtitan() -> bool:
    try:
        import torchtitan.models.qwen3  # noqa: F401
    except ImportError as err:
        print(f"torchtitan skipped: {err} (pip install -e '.[bench]')")
        return False
    return True


def batch(vocab_size: int):
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    return tokens, labels


def hf_model(config: str):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(hf_config(model_cfg(config)))


def torchtitan_model(cfg, hf_sd: dict, max_seq_len: int):
    """torchtitan's Qwen3 for our model config `cfg` (its shipped layer builder; SDPA attention, which its
    language models otherwise reserve for other uses), holding the weights of the HF state dict `hf_sd`.
    Built on the current default device."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, _build_qwen3_layers, _qwen3_norm

    layers = _build_qwen3_layers(
        n_layers=cfg.num_hidden_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_dim=cfg.intermediate_size,
        attn_backend="flex", rope=CosSinRoPE.Config(dim=cfg.head_dim, max_seq_len=max_seq_len, theta=cfg.rope_theta))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config_tt = Qwen3Model.Config(
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, norm=_qwen3_norm(cfg.hidden_size), enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.hidden_size),
        lm_head=Linear.Config(in_features=cfg.hidden_size, out_features=cfg.vocab_size), layers=layers)
    model = config_tt.build()
    model.load_state_dict(Qwen3StateDictAdapter(config_tt, None).from_hf(dict(hf_sd)))
    return model


def build(name: str, config: str, hf=None):
    """(model, step function) for one system; `hf` (transformers' model) supplies the weights."""
    hf = hf if hf is not None else hf_model(config)
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
    elif name in ("ours", "ours_reference"):
        cfg = model_cfg(config)
        model = Qwen3(cfg, ops=OPS if name == "ours" else "reference").train()
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

    def step():
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


def check_logits(models: dict, vocab_size: int) -> float:
    """Largest logit difference of every system from transformers' (asserted within fp32 tolerance)."""
    tokens, _ = batch(vocab_size)
    ref = logits_of("transformers", models["transformers"], tokens)
    worst = 0.0
    for name, model in models.items():
        got = logits_of(name, model, tokens)
        torch.testing.assert_close(got, ref, msg=lambda m: f"{name} logits differ from transformers': {m}")
        worst = max(worst, (got - ref).abs().max().item())
    return worst


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def compile_layers(name: str, model) -> None:
    """What each system's own compile switch does: ours and torchtitan compile each decoder layer."""
    if name == "transformers":
        model.compile()
        return
    for layer in model.layers.values():
        layer.compile()


def bench_training(config: str, systems, steps: int, compile_: bool, clock) -> dict:
    hf = hf_model(config)
    runs = {name: build(name, config, hf) for name in systems}
    max_diff = check_logits({name: model for name, (model, _) in runs.items()}, hf.config.vocab_size)
    if compile_:
        for name, (model, step) in runs.items():
            compile_layers(name, model)
            step()  # compiles; the start-up is timed in a fresh process (child)
    times = {name: [] for name in runs}
    for i in range(steps + 1):  # the first round warms up and is not timed
        for name, (_, step) in runs.items():
            elapsed = timed(step, clock)
            if i:
                times[name].append(elapsed)
    del runs, hf
    result = {"max_logit_diff": max_diff, "systems": {}}
    for name, t in times.items():
        row = {"median_tokens_per_s": BATCH * SEQ / statistics.median(t), "best_tokens_per_s": BATCH * SEQ / min(t)}
        result["systems"][name] = row | child(name, config, compile_)
    return result


def profile(config: str, systems, rows: int) -> None:
    """torch.profiler table of one training step per system (after one untimed step), by self CPU time."""
    hf = hf_model(config)
    for name in systems:
        _, step = build(name, config, hf)
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        print(f"\n{config} {name}:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def child(name: str, config: str, compile_: bool) -> dict:
    """One system alone in a fresh process with an empty compile cache (run_child): {"peak_rss_gb"}, or with
    compile_ {"compile_s"}."""
    cmd = [sys.executable, __file__, "--child", name, "--configs", config] + ["--compile"] * compile_
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_child(name: str, config: str, compile_: bool) -> None:
    """Print as JSON the peak RSS in GB of two training steps, or with compile_ the wall time of the first
    compiled step (compilation, its compiler subprocesses included, plus one step) from a cold cache."""
    model, step = build(name, config)
    if compile_:
        compile_layers(name, model)
        print(json.dumps({"compile_s": timed(step)}))
        return
    step()
    step()
    print(json.dumps({"peak_rss_gb": peak_memory_gb(torch.device("cpu"))}))


def print_training(config: str, result: dict, compile_: bool) -> None:
    rows = result["systems"]
    print(f"\n{config}: {CONFIGS[config]['vocab_size']} vocab, batch {BATCH}x{SEQ}, fp32, "
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


def decode_speed(ours, hf, prompt, new_tokens: int, repeats: int, dtype, clock=time.perf_counter) -> tuple:
    """Greedy decode tokens/s of our engine and of transformers' static-cache `generate` on the same weights,
    alternating; each the median over `repeats`, the prefill (a 1-token generation) subtracted out.
    Returns ({"ours": tokens/s, "transformers": tokens/s}, whether both generated the same ids)."""
    from speedllm.generation.engine import generate_ids
    from speedllm.generation.sampling import Sampling

    def run_hf(n):
        with torch.inference_mode():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
        return out[:, prompt.shape[1]:].tolist()

    def run_ours(n):
        return generate_ids(ours, prompt.tolist(), n, Sampling(), [], 0, dtype)

    runners = {"transformers": run_hf, "ours": run_ours}
    ids = {name: fn(new_tokens) for name, fn in runners.items()}  # warm-up (static cache, kernels)
    times = {name: ([], []) for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            times[name][0].append(timed(lambda: fn(new_tokens), clock))
            times[name][1].append(timed(lambda: fn(1), clock))
    speed = {name: prompt.shape[0] * (new_tokens - 1) / (statistics.median(full) - statistics.median(first))
             for name, (full, first) in times.items()}
    return speed, ids["ours"] == ids["transformers"]


def bench_decode(new_tokens: int, repeats: int, clock) -> list:
    """Decode at batch 1 and 8 on the vocab_32k model, fp32: [(batch, tokens/s by system, same ids)]."""
    cfg = model_cfg("vocab_32k")
    hf = hf_model("vocab_32k").eval()
    ours = Qwen3(cfg, ops=OPS).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch_size in (1, 8):
        prompt = torch.randint(0, cfg.vocab_size, (batch_size, 16), generator=gen)
        rows.append((batch_size, *decode_speed(ours, hf, prompt, new_tokens, repeats, torch.float32, clock)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["vocab_32k", "qwen3_vocab"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:-1]))
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd steps")
    parser.add_argument("--decode", action="store_true", help="also time greedy decoding against transformers")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=list(CLOCK), default="wall",
                        help="cpu: this process's CPU time (use with --threads 1 on a machine shared with other jobs)")
    parser.add_argument("--profile", type=int, metavar="ROWS", help="print a profiler table per system instead")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.configs[0], args.compile)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    titan = have_torchtitan()
    systems = [s for s in args.systems if titan or not s.startswith("torchtitan")]
    with open("/proc/loadavg") as f:
        print(f"load average at start: {f.read().split()[0]} on {torch.get_num_threads()} threads")
    clock = CLOCK[args.clock]
    for config in args.configs:
        if args.profile:
            profile(config, systems, args.profile)
            continue
        print_training(config, bench_training(config, systems, args.steps, False, clock), False)
        if args.compile:
            print_training(config, bench_training(config, systems, args.steps, True, clock), True)
    if args.decode:
        print(f"\ndecode (vocab_32k, fp32, greedy, {args.new_tokens} new tokens, median of 3, prefill subtracted)")
        print("| batch | transformers static cache tokens/s | ours tokens/s | ratio | same ids |\n|---|---|---|---|---|")
        for batch_size, decode, same in bench_decode(args.new_tokens, 3, clock):
            print(f"| {batch_size} | {decode['transformers']:.1f} | {decode['ours']:.1f} | "
                  f"x{decode['ours'] / decode['transformers']:.2f} | {same} |")
    with open("/proc/loadavg") as f:
        print(f"load average at end: {f.read().split()[0]}")


if __name__ == "__main__":
    main()
