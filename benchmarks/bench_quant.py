"""Quantized decode speed: fp32 vs int8_wo vs int8_dyn vs int4_wo, ours vs transformers with the same torchao
quantization.

    python -m benchmarks quant [--sizes 40m 0.6b] [--batches 1 8] [--new-tokens 16] [--repeats 3]
                               [--paths native avx2 generic] [--no-transformers] [--dry]

Random weights at two sizes: `generate`'s ~40M Qwen3 and conf/model/qwen3_0.6b.yaml. Every runner works
on the same fp32 weights (shared, not copied; the quantized variants hold only their own quantized tensors),
greedy, one thread (--threads), and all runners of a size take turns within each repeat, so load from other processes
hits them alike. Decode tokens/s = batch x (N - 1) / (time of N new tokens - time of 1), the median over
--repeats, timed with this process's CPU time (on a shared machine wall time mostly measures the scheduler;
on a quiet one `--threads 0 --clock wall` times what a user's decode gets, on every core).
transformers int8_wo holds the same int8 numbers as ours: torchao Int8WeightOnly projections and output
projection, and the embedding's dequantized int8 rows. transformers has no int4 row: torchao's int4 needs the
CUDA-only mslk kernels.
int8_dyn is ours only (torchao's int8 weights times per-row int8 activations on the CPU's integer dot products).
--paths runs our int8_wo / int8_dyn / int4_wo rows once per CPU kernel path (speedllm.native: `native` is the best this CPU
supports, the others are forced with SPEEDLLM_CPU_ISA, switched between runs in this one process), all taking
turns with the same fp32 row; the header names the CPU and its paths. --dry: the `tiny` size, batch 1.
"""

import torch
from omegaconf import OmegaConf
from torch import nn

from benchmarks.common import (CLOCKS, CONFIGS, decode_rates, hf_greedy, make_parser, on_path, ours_greedy,
                               parse)
from speedllm.config.schema import QuantConfig
from speedllm.models import Qwen3, num_params
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config
from speedllm.native import cpu_name, supported_isas
from speedllm.paths import CONF
from speedllm.quant import QUANTIZED, quantize_for_inference
from speedllm.quant.int8 import quantize_int8

PROMPT_LEN = 16
OPS = OmegaConf.load(CONF / "hardware" / "cpu.yaml").ops  # ours runs the op set `task=generate hardware=cpu` runs
SIZES = {
    "40m": dict(name="bench_40m", **CONFIGS["vocab_32k"], tie_word_embeddings=True),
    "0.6b": None,  # conf/model/qwen3_0.6b.yaml
    "tiny": dict(name="tiny", **CONFIGS["tiny"], tie_word_embeddings=True),  # --dry
}


def model_cfg(size: str):
    fields = SIZES[size] or OmegaConf.load(CONF / "model" / "qwen3_0.6b.yaml")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), fields)


def runners(cfg, paths=("native",), transformers=True):
    """name -> generate(prompt_BS, new_tokens) -> token ids, all over one set of fp32 weights."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).eval()
    state = from_hf_state_dict(hf.state_dict(), cfg)

    def ours(name):
        with torch.device("meta"):
            model = Qwen3(cfg, ops=OPS)
        model.load_state_dict(state, assign=True)  # shares the fp32 tensors; quantizing replaces only its own
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return quantize_for_inference(model.eval(), OmegaConf.structured(QuantConfig(name=name)))

    def transformers_int8():
        with torch.device("meta"):
            hf_int8 = Qwen3ForCausalLM(hf_config(cfg)).eval()
        hf_int8.load_state_dict(hf.state_dict(), assign=True)
        hf_int8.tie_weights()
        for name, buffer in hf.named_buffers():  # RoPE tables are not in the state dict
            module, _, attr = name.rpartition(".")
            setattr(hf_int8.get_submodule(module), attr, buffer)
        # The int8 tables ours uses: the output projection (untied) through torchao, the embedding's rows dequantized.
        hf_int8.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone(), requires_grad=False)
        quantize_(hf_int8, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: fqn.rsplit(".", 1)[-1] in QUANTIZED + ("lm_head",))
        q, scale = quantize_int8(hf.model.embed_tokens.weight)
        hf_int8.model.embed_tokens.weight = nn.Parameter(q.float() * scale[:, None], requires_grad=False)
        return hf_int8

    models = {name: ours(name) for name in ("none", "int8_wo", "int8_dyn", "int4_wo")}
    print(f"{cfg.name}: {num_params(models['none']) / 1e6:.0f}M parameters")
    runs = {"ours fp32": ours_greedy(models["none"]), "ours int8_wo": ours_greedy(models["int8_wo"]),
            "ours int8_dyn": ours_greedy(models["int8_dyn"]), "ours int4_wo": ours_greedy(models["int4_wo"])}
    if transformers:
        runs = {**runs, "transformers fp32": hf_greedy(hf), "transformers int8_wo": hf_greedy(transformers_int8())}
    for path in paths:
        if path != "native":
            for name in ("int8_wo", "int8_dyn", "int4_wo"):
                runs[f"ours {name} ({path})"] = on_path(path, ours_greedy(models[name]))
    return runs


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--sizes", nargs="+", default=["40m", "0.6b"], choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", nargs="+", default=["native"], choices=["native", *supported_isas()],
                        help="CPU kernel paths for our quantized rows (native: the best this CPU supports)")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="only our rows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default, all cores)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                        help="wall: for a quiet machine (the CPU clock adds up the threads' time)")
    args = parse(parser, argv, sizes=["tiny"], batches=[1], new_tokens=4, repeats=1)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock, threads = CLOCKS[args.clock], torch.get_num_threads()
    print(f"CPU: {cpu_name()}; kernel paths it supports: {', '.join(supported_isas())} (native: "
          f"{supported_isas()[0]})")
    for size in args.sizes:
        cfg = model_cfg(size)
        runs = runners(cfg, args.paths, args.transformers)
        for batch in args.batches:
            prompt = torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
            rate, tokens = decode_rates(runs, prompt, args.new_tokens, args.repeats, clock, warmup=0)
            print(f"{size} batch {batch}: decode tokens/s ({args.clock} clock, {threads} thread{'s' * (threads > 1)})")
            for name in runs:
                precision = name.split()[1]
                same = tokens[name] == tokens[f"ours {precision}"]
                line = f"  {name:<26} {rate[name]:8.1f}   x{rate[name] / rate['ours fp32']:.2f} of ours fp32"
                if name.startswith("transformers"):
                    line += f", ours/transformers x{rate[f'ours {precision}'] / rate[name]:.2f}, same tokens: {same}"
                elif "(" in name:
                    line += f", same tokens as native: {same}"
                print(line, flush=True)
