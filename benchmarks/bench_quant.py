"""Quantized decode speed: fp32 vs int8_wo vs int4_wo, ours vs transformers with the same torchao quantization.

    python benchmarks/bench_quant.py [--sizes 40m 0.6b] [--batches 1 8] [--new-tokens 16] [--repeats 3]

Random weights at two sizes: bench_generate's ~40M Qwen3 and conf/model/qwen3_0.6b.yaml. Every runner works
on the same fp32 weights (shared, not copied; the quantized variants hold only their own quantized tensors),
greedy, one thread, and all runners of a size take turns within each repeat, so load from other processes
hits them alike. Decode tokens/s = batch x (N - 1) / (time of N new tokens - time of 1), the median over
--repeats, timed with this process's CPU time (on a shared machine wall time mostly measures the scheduler).
transformers int8_wo holds the same int8 numbers as ours: torchao Int8WeightOnly projections and output
projection, and the embedding's dequantized int8 rows. transformers has no int4 row: torchao's int4 needs the
CUDA-only mslk kernels.
"""

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf
from torch import nn

from speedllm.config.schema import QuantConfig
from speedllm.generation.engine import generate_ids
from speedllm.generation.sampling import Sampling
from speedllm.models import Qwen3, num_params
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config
from speedllm.paths import CONF
from speedllm.quant import QUANTIZED, quantize_for_inference
from speedllm.quant.int8 import quantize_int8

PROMPT_LEN = 16
SIZES = {
    "40m": dict(name="bench_40m", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    "0.6b": None,  # conf/model/qwen3_0.6b.yaml
}


def model_cfg(size: str):
    fields = SIZES[size] or OmegaConf.load(CONF / "model" / "qwen3_0.6b.yaml")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), fields)


def runners(cfg):
    """name -> generate(prompt_BS, new_tokens) -> token ids, all over one set of fp32 weights."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).eval()
    state = from_hf_state_dict(hf.state_dict(), cfg)

    def ours(name):
        with torch.device("meta"):
            model = Qwen3(cfg)
        model.load_state_dict(state, assign=True)  # shares the fp32 tensors; quantizing replaces only its own
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return quantize_for_inference(model.eval(), OmegaConf.structured(QuantConfig(name=name)))

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

    def run_ours(model):
        return lambda prompt, n: generate_ids(model, prompt.tolist(), n, Sampling(), [], 0, torch.float32)

    def run_hf(model):
        def generate(prompt, n):
            with torch.inference_mode():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
            return out[:, prompt.shape[1]:].tolist()
        return generate

    models = {name: ours(name) for name in ("none", "int8_wo", "int4_wo")}
    print(f"{cfg.name}: {num_params(models['none']) / 1e6:.0f}M parameters")
    return {
        "ours fp32": run_ours(models["none"]), "transformers fp32": run_hf(hf),
        "ours int8_wo": run_ours(models["int8_wo"]), "transformers int8_wo": run_hf(hf_int8),
        "ours int4_wo": run_ours(models["int4_wo"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time
    for size in args.sizes:
        cfg = model_cfg(size)
        runs = runners(cfg)
        for batch in args.batches:
            prompt = torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
            times = {name: ([], []) for name in runs}
            tokens = {}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    for slot, n in enumerate((1, args.new_tokens)):
                        start = clock()
                        tokens[name] = run(prompt, n)
                        times[name][slot].append(clock() - start)
            rate = {name: batch * (args.new_tokens - 1) / (statistics.median(t[1]) - statistics.median(t[0]))
                    for name, t in times.items()}
            print(f"{size} batch {batch}: decode tokens/s (CPU clock, 1 thread)")
            for name in runs:
                precision = name.split()[-1]
                same = tokens[name] == tokens[f"ours {precision}"]
                line = f"  {name:<22} {rate[name]:8.1f}   x{rate[name] / rate['ours fp32']:.2f} of ours fp32"
                if name.startswith("transformers"):
                    line += f", ours/transformers x{rate[f'ours {precision}'] / rate[name]:.2f}, same tokens: {same}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
