"""The hybrid family (Qwen3.5: Gated DeltaNet layers beside gated attention) on a CPU: our model against
transformers' Qwen3_5ForCausalLM on the same weights.

    python -m benchmarks hybrid [--steps 5] [--dtypes float32 bfloat16] [--new-tokens 32] [--lengths 2048 8192] [--dry]

train   one forward+backward of a ~40M-parameter Qwen3.5 (8 layers, 6 Gated DeltaNet + 2 gated attention, 512 wide,
        vocab 32,000) on a 4 x 256 batch, both models in the same process, timed alternately step by step (the
        fastest step of each -> tokens/s); peak RSS of one step of each in a fresh process (VmHWM, the ~0.3 GB of
        the Python/torch runtime included). Per dtype: float32, and bfloat16 (both models' weights in bf16).
        Targets: ours >= 3x transformers' tokens/s at <= its peak memory.
decode  batch-1 greedy decode of the same model: our engine (chunked prefill, then the recurrent rule through the
        per-layer cache) against transformers' `generate`, prefill subtracted out, interleaved; same ids checked.
        Target: >= 2x.
length  our forward+backward of a stack of Gated DeltaNet layers only (4 x 512 wide, batch 1) at each length:
        the step time at the longest length over the shortest (linear cost: 4x from 2048 to 8192; target <= 4.5x).
--dry: two layers 128 wide, float32, one step, 4 new tokens, lengths 64 and 256.
"""

import argparse
import json
import statistics

import torch

from benchmarks.common import decode_rates, hf_greedy, in_fresh_process, interleaved, make_parser, ours_greedy, parse
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config
from speedllm.models.qwen3 import Qwen3
from speedllm.train.metrics import peak_memory_gb

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GDN, ATTN = "linear_attention", "full_attention"
HYBRID = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              layer_types=[GDN, GDN, GDN, ATTN] * 2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              tie_word_embeddings=True)
DRY = dict(HYBRID, vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           layer_types=[GDN, ATTN], num_attention_heads=4, head_dim=32, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)
QWEN3_5 = dict(attention_output_gate=True, zero_centered_norm=True, partial_rotary_factor=0.25,
               rope_theta=10_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)
BATCH, SEQ = 4, 256


def config(fields: dict):
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "hybrid", **QWEN3_5, **fields})


def pair(fields: dict, dtype, which=("ours", "transformers")) -> dict:
    """{name: model} of our model and transformers' on the same weights (seed 0), in `dtype`."""
    from transformers import Qwen3_5ForCausalLM

    cfg = config(fields)
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(hf_config(cfg))
    models = {}
    if "ours" in which:
        ours = Qwen3(cfg, ops="cpu")
        ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
        models["ours"] = ours.to(dtype)
    if "transformers" in which:
        models["transformers"] = hf.to(dtype)
    return models


def train_step(name: str, model, tokens):
    """A no-argument forward+backward on `tokens`: the mean next-token cross-entropy (transformers shifts its
    labels itself; ours takes them shifted)."""
    shifted = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    count = (shifted != -100).sum()
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        if name == "transformers":
            model(tokens, labels=tokens).loss.backward()
        else:
            ce_sum, aux = model(tokens, labels=shifted)
            (ce_sum / count + aux).backward()
    return step


def batch(vocab: int, rows: int, length: int):
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))


def memory_child(name: str, dry: bool, dtype: str) -> None:
    fields = DRY if dry else HYBRID
    (model,) = pair(fields, DTYPES[dtype], (name,)).values()
    train_step(name, model, batch(fields["vocab_size"], BATCH, SEQ))()
    print(json.dumps({"peak_rss_gb": peak_memory_gb(torch.device("cpu"))}))


def bench_train(args, fields: dict) -> dict:
    rows = {}
    for dtype in args.dtypes:
        models = pair(fields, DTYPES[dtype])
        tokens = batch(fields["vocab_size"], BATCH, SEQ)
        times, _ = interleaved({n: train_step(n, m, tokens) for n, m in models.items()}, args.steps, warmup=1)
        params = sum(p.numel() for p in models["ours"].parameters())
        del models
        row = {"params": params}
        for name in times:
            peak = in_fresh_process(__name__, "--memory-child", name, "--dtypes", dtype, *(["--dry"] * args.dry))
            row[name] = {"tokens_per_s": BATCH * SEQ / min(times[name]), "peak_rss_gb": peak["peak_rss_gb"]}
        rows[dtype] = row
    return rows


def bench_decode(args, fields: dict) -> tuple:
    models = pair(fields, torch.float32)
    for model in models.values():
        model.eval()
    prompt = batch(fields["vocab_size"], 1, 16)
    runners = {"transformers": hf_greedy(models["transformers"]), "ours": ours_greedy(models["ours"])}
    rates, ids = decode_rates(runners, prompt, args.new_tokens, args.repeats)
    return rates, ids["ours"] == ids["transformers"]


def bench_length(args, fields: dict) -> dict:
    gdn_only = config(dict(fields, num_hidden_layers=4, layer_types=[GDN] * 4))
    torch.manual_seed(0)
    model = Qwen3(gdn_only, ops="cpu")
    model.init_weights(seed=0)
    steps = {n: train_step("ours", model, batch(gdn_only.vocab_size, 1, n)) for n in args.lengths}
    times, _ = interleaved(steps, args.steps, warmup=1)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--memory-child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = parse(parser, argv, steps=1, repeats=1, new_tokens=4, lengths=[64, 256], dtypes=["float32"])
    if args.memory_child:
        memory_child(args.memory_child, args.dry, args.dtypes[0])
        return
    fields = DRY if args.dry else HYBRID
    threads = torch.get_num_threads()
    train = bench_train(args, fields)
    print(f"train: Qwen3.5 hybrid fwd+bwd, batch {BATCH}x{SEQ}, {threads} threads, fastest of {args.steps} steps")
    print("| dtype | params | transformers tokens/s | ours tokens/s | ratio | transformers peak RSS GB | "
          "ours peak RSS GB |")
    print("|---|---|---|---|---|---|---|")
    for dtype, row in train.items():
        ours, hf = row["ours"], row["transformers"]
        print(f"| {dtype} | {row['params'] / 1e6:.1f}M | {hf['tokens_per_s']:.0f} | {ours['tokens_per_s']:.0f} | "
              f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x | {hf['peak_rss_gb']:.2f} | {ours['peak_rss_gb']:.2f} |")
    rates, same = bench_decode(args, fields)
    print(f"decode: batch 1, {args.new_tokens} greedy tokens after 16, float32: transformers "
          f"{rates['transformers']:.1f} tokens/s, ours {rates['ours']:.1f} tokens/s, "
          f"ratio {rates['ours'] / rates['transformers']:.2f}x, same ids: {'yes' if same else 'no'}")
    seconds = bench_length(args, fields)
    short, long = min(seconds), max(seconds)
    print(f"length: Gated DeltaNet-only stack fwd+bwd, median of {args.steps}: "
          + ", ".join(f"seq {n} {s:.3f} s" for n, s in seconds.items())
          + f"; {long} / {short} = {seconds[long] / seconds[short]:.2f}x (linear: {long / short:.1f}x)")
