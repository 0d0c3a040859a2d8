"""quant=: int8/int4 weight-only inference against torchao's own quantization in transformers, the int4 CPU kernel
against torchao's dequantized weights, QAT fake quantization equal to the int4 it converts to, the quantized HF
export loaded by transformers, the planner's bytes per weight, and the before-launch refusals."""

import copy

import pytest
import torch
from omegaconf import OmegaConf
from test_generate import hf_greedy
from torch import nn

from speedllm.config import compose_config as composed
from speedllm.config.schema import QuantConfig
from speedllm.generation.engine import generate_ids
from speedllm.generation.sampling import Sampling
from speedllm.paths import CONF
from speedllm.quant import QUANTIZED, bytes_per_weight, is_quantized, qat_int4_config, quantize_for_inference

torchao = pytest.importorskip("torchao")

GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
PROMPTS = [[5, 17, 3, 88], [9, 2], [40, 41, 42, 43, 44, 45], [77]]


def quant(name, group_size=32):
    return OmegaConf.structured(QuantConfig(name=name, group_size=group_size))


@pytest.fixture
def model_pair(hf_pair):
    """A tiny random transformers Qwen3 and ours with the same weights (widths divisible by group size 32)."""
    _, hf, ours = hf_pair(vocab_size=128, hidden_size=64, intermediate_size=128, initializer_range=0.1)
    return hf, ours


def test_every_quant_option_composes():
    for path in sorted((CONF / "quant").glob("*.yaml")):
        assert composed(f"quant={path.stem}").quant.name == path.stem


def test_int8_wo_generates_the_tokens_of_transformers_with_the_same_torchao_quantization(model_pair):
    """Ours (int8 kernel, int8 embedding and output projection) against transformers whose projections and
    output projection are torchao Int8WeightOnly tensors and whose embedding holds torchao's dequantized rows."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from speedllm.quant.int8 import Int8Embedding, Int8Linear

    hf, ours = model_pair
    quantize_for_inference(ours, quant("int8_wo"))
    hf.lm_head.weight = nn.Parameter(hf.lm_head.weight.detach().clone(), requires_grad=False)  # untie
    quantize_(hf, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn.rsplit(".", 1)[-1] in QUANTIZED + ("lm_head",))
    quantized = [name for name, m in ours.named_modules() if isinstance(m, Int8Linear)]
    assert len(quantized) == 7 * 2 + 1 and isinstance(ours.embed_tokens, Int8Embedding)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight.dequantize())  # torchao's int8 numbers exactly
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed_tokens.weight)
    ids = generate_ids(ours, PROMPTS, 12, GREEDY, stop_ids=[], pad_id=0, dtype=torch.float32)
    assert ids == hf_greedy(hf, PROMPTS, 12)


@pytest.mark.parametrize("rows", [1, 3, 11])
def test_int8_kernel_equals_its_reference_twin(rows):
    from speedllm.quant.int8 import int8_wo_mm, int8_wo_mm_reference, kernel, quantize_int8

    if kernel() is None:
        pytest.skip("no C compiler here: int8 layers run the reference twin")
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(40, 208))  # 208 = 3 x 64 + 16: the unrolled loop and its tail
    x = torch.randn(rows, 208)
    torch.testing.assert_close(int8_wo_mm(x, q, scale), int8_wo_mm_reference(x, q, scale), rtol=1e-5, atol=1e-5)
    assert torch.equal(int8_wo_mm(x.bfloat16(), q, scale), int8_wo_mm(x.bfloat16().float(), q, scale).bfloat16())


def test_int4_linear_computes_with_torchaos_dequantized_weight():
    from torchao.quantization.utils import groupwise_affine_dequantize_tensor_from_qparams

    from speedllm.quant.int4 import Int4Linear, quantize_int4

    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    q, scales, zeros = quantize_int4(linear.weight, 64)
    dequant = groupwise_affine_dequantize_tensor_from_qparams(q, scales, zeros, 4, 64)
    x = torch.randn(2, 3, 256)
    expected = x @ dequant.t()
    got = Int4Linear.from_linear(linear, 64)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # bf16 activations in the kernel: errors of bf16 rounding, far below the int4 error itself
    assert (got - expected).abs().max() < 2e-2 * expected.abs().max()
    assert (expected - linear(x)).abs().max() > 5 * (got - expected).abs().max()


def test_qat_fake_quantization_is_exactly_the_int4_it_converts_to():
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.utils import groupwise_affine_dequantize_tensor_from_qparams

    from speedllm.quant.int4 import quantize_int4

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64, bias=False))
    weight = model[0].weight.detach().clone()
    quantize_(model, QATConfig(weight_config=qat_int4_config(32), step="prepare"))
    fake = model[0].weight_fake_quantizer(model[0].weight)
    assert torch.equal(fake, groupwise_affine_dequantize_tensor_from_qparams(*quantize_int4(weight, 32), 4, 32))


def test_int4_and_int8_models_stay_close_to_fp32_on_text_the_fp32_model_wrote(model_pair):
    _, ours = model_pair
    torch.manual_seed(1)
    text = torch.tensor([p[:1] for p in PROMPTS] * 2)
    with torch.no_grad():  # 40 tokens sampled from the fp32 model: text it finds likely
        for _ in range(40):
            text = torch.cat([text, torch.multinomial(torch.softmax(ours(text)[:, -1], -1), 1)], 1)

    def perplexity(model):
        with torch.no_grad():
            ce, _ = model(text[:, :-1], labels=text[:, 1:])
        return float(torch.exp(ce / text[:, 1:].numel()))

    fp32 = perplexity(ours)
    int8 = perplexity(quantize_for_inference(copy.deepcopy(ours), quant("int8_wo")))
    int4 = perplexity(quantize_for_inference(copy.deepcopy(ours), quant("int4_wo")))
    assert abs(int8 / fp32 - 1) < 0.01 and abs(int4 / fp32 - 1) < 0.05
    assert abs(int4 / fp32 - 1) > abs(int8 / fp32 - 1)  # fewer bits, further away


def test_int8_hf_export_loads_in_transformers_with_the_same_greedy_tokens(model_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from speedllm.tasks.convert import hf_to_dcp, run

    hf, ours = model_pair
    hf.save_pretrained(tmp_path / "hf")
    cfg = composed("task=convert", f"checkpoint.load_hf={tmp_path / 'hf'}", "convert.to=dcp",
                   f"convert.out={tmp_path / 'dcp'}", "logging.progress_bar=false", f"run_dir={tmp_path}")
    hf_to_dcp(cfg.checkpoint.load_hf, cfg.convert.out, cfg)
    cfg = composed("task=convert", f"checkpoint.load={tmp_path / 'dcp'}", "convert.to=hf", "quant=int8_wo",
                   f"convert.out={tmp_path / 'q'}", "logging.progress_bar=false", f"run_dir={tmp_path}")
    run(cfg, None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    assert type(loaded.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    assert type(loaded.lm_head.weight) is nn.Parameter and loaded.lm_head.weight.dtype == torch.float32
    assert not (tmp_path / ".q.fp").exists()
    quantize_for_inference(ours, quant("int8_wo"))
    assert hf_greedy(loaded, PROMPTS, 12) == generate_ids(ours, PROMPTS, 12, GREEDY, [], 0, torch.float32)


def test_bytes_per_weight_follow_the_stored_format():
    assert bytes_per_weight("none", 4.0) == 4.0 and bytes_per_weight("float8", 2.0) == 1.0
    assert bytes_per_weight("int8_wo", 4.0) == 1.0
    # int4 at group 128: half a byte plus an fp32 scale and zero per 128 weights, as Int4Linear stores them
    from speedllm.quant.int4 import Int4Linear

    layer = Int4Linear.from_linear(nn.Linear(1024, 512, bias=False), 128)
    stored = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert stored == bytes_per_weight("int4_wo", 4.0, 128) * 1024 * 512 == bytes_per_weight("qat_int4", 4.0, 128) * 1024 * 512
    assert is_quantized(nn.Linear(2, 2), "layers.0.mlp.up_proj") and not is_quantized(nn.Linear(2, 2), "lm_head")


@pytest.mark.parametrize("overrides,message", [
    (["quant=float8", "hardware=cpu"],
     "quant=float8 needs float8 matmuls (NVIDIA SM 8.9+: H100/H200, hardware=h100|h200) but hardware=cpu (cpu) has "
     "none; use quant=none (float32) there, or quant=qat_int4 to train for int4 inference"),
    (["quant=float8", "hardware=a100"],
     "quant=float8 needs float8 matmuls (NVIDIA SM 8.9+: H100/H200, hardware=h100|h200) but hardware=a100 (cuda) has "
     "none; use quant=none (bfloat16) there, or quant=qat_int4 to train for int4 inference"),
    (["quant=int8_wo"],
     "quant=int8_wo quantizes a trained model for inference (task=generate/chat/evaluate/convert); to train for int4 "
     "use quant=qat_int4, else quant=none"),
    (["task=generate", "quant=int4_wo", "quant.group_size=256", "parallel=tp2"],  # the default model: widths 256, 768
     "quant.group_size=256 must divide the input width of each tensor-parallel shard under parallel.tp=2 "
     "(num_attention_heads x head_dim / tp=128, intermediate_size / tp=384); pick a divisor"),
])
def test_quant_refused_before_launch_in_one_line(overrides, message, launch, tmp_path):
    code, out, err = launch(tmp_path, *overrides)
    assert code == 2 and err.strip() == f"error: {message}"
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize("name", ["int8_wo", "int4_wo"])
def test_planner_inference_weight_bytes_match_the_quantized_model(name, tiny_model_cfg):
    from speedllm.models import Qwen3
    from speedllm.planner.memory import inference_weight_bytes

    cfg = tiny_model_cfg(vocab_size=128, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=128)
    model = quantize_for_inference(Qwen3(cfg).eval(), quant(name, 128))
    stored = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        parts = [getattr(tensor, n) for n in tensor.tensor_data_names] if hasattr(tensor, "tensor_data_names") else [tensor]
        stored += sum(p.numel() * p.element_size() for p in parts)
    planned, plain = inference_weight_bytes(cfg, quant(name, 128), "float32")
    assert plain == sum(p.numel() * 4 for p in Qwen3(cfg).parameters())
    assert planned == pytest.approx(stored, rel=0.015)  # int8: per-row scales are not counted


def test_qat_int4_training_computes_with_the_int4_weights_inference_will_use(tmp_path):
    """The training build path under quant=qat_int4: its loss is the loss of the same initial model with every
    projection replaced by its int4 dequantization (torchao's), and gradients reach the fp32 weights."""
    from test_train_loop import config
    from torchao.quantization.utils import groupwise_affine_dequantize_tensor_from_qparams

    from speedllm.quant.int4 import quantize_int4
    from speedllm.runtime import Runtime
    from speedllm.train.build import build_model

    qat = build_model(config(tmp_path, "quant=qat_int4", "quant.group_size=32"), Runtime()).module
    plain = build_model(config(tmp_path, "quant=none"), Runtime()).module
    plain.load_state_dict(qat.state_dict())  # same keys: QAT keeps the fp32 weights under their names
    with torch.no_grad():
        for fqn, module in plain.named_modules():
            if is_quantized(module, fqn):
                module.weight.copy_(groupwise_affine_dequantize_tensor_from_qparams(
                    *quantize_int4(module.weight, 32), 4, 32))
    assert sum(type(m).__name__ == "FakeQuantizedLinear" for m in qat.modules()) == 7 * 2
    torch.manual_seed(0)
    tokens, labels = torch.randint(0, 8192, (2, 32)), torch.randint(0, 8192, (2, 32))
    loss, _ = qat(tokens, labels=labels)
    with torch.no_grad():
        expected, _ = plain(tokens, labels=labels)
    assert torch.allclose(loss, expected, rtol=1e-5)
    loss.backward()
    assert qat.layers["0"].mlp.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", ["int8_wo", "int4_wo"])
def test_quantizing_while_loading_equals_quantizing_the_loaded_model(name, tied, save_tiny_hf, tmp_path):
    """load_model quantizes piece by piece as it reads (HF directory and DCP checkpoint); the result is the
    full-precision model loaded whole and then quantized, tensor for tensor."""
    from speedllm.config.resolve import adopt_checkpoint_config
    from speedllm.generation.load import load_model
    from speedllm.runtime import Runtime
    from speedllm.tasks.convert import hf_to_dcp

    save_tiny_hf(tmp_path / "hf", tokenizer=False, vocab_size=128, hidden_size=64, intermediate_size=128,
                 tie_word_embeddings=tied)
    base = ["task=generate", "hardware=cpu", "hardware.dtype=float32", f"run_dir={tmp_path}", "quant.group_size=32"]
    hf = ["model=hf", f"checkpoint.load_hf={tmp_path / 'hf'}"]
    hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), composed(*base, *hf))
    expected = quantize_for_inference(load_model(composed(*base, *hf), Runtime()), quant(name)).state_dict()
    for source in (hf, [f"checkpoint.load={tmp_path / 'dcp'}"]):
        cfg = composed(*base, *source, f"quant={name}")
        adopt_checkpoint_config(cfg)
        got = load_model(cfg, Runtime()).state_dict()
        assert list(got) == list(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected), source


def test_quantizing_while_loading_never_holds_the_full_precision_model(save_tiny_hf, tmp_path):
    """Peak live tensor bytes while loading int8_wo: the int8 model plus about one fp32 layer, against the fp32
    model's own bytes (which loading then quantizing holds whole, measured the same way)."""
    from speedllm.generation.load import load_model
    from speedllm.planner.measure import PeakTensorMemory
    from speedllm.runtime import Runtime

    save_tiny_hf(tmp_path / "hf", tokenizer=False, vocab_size=128, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=8, tie_word_embeddings=True)
    base = ["task=generate", "hardware=cpu", "hardware.dtype=float32", f"run_dir={tmp_path}", "model=hf", f"checkpoint.load_hf={tmp_path / 'hf'}"]
    with PeakTensorMemory() as whole:
        fp32 = load_model(composed(*base), Runtime())
        fp32_bytes = sum(p.numel() * 4 for p in fp32.parameters())
        quantize_for_inference(fp32, quant("int8_wo"))
    with PeakTensorMemory() as streamed:
        int8 = load_model(composed(*base, "quant=int8_wo"), Runtime())
    int8_bytes = sum(b.numel() * b.element_size() for b in int8.buffers())
    assert whole.peak >= fp32_bytes
    assert streamed.peak < int8_bytes + 2 * fp32_bytes / 8 < 0.6 * fp32_bytes
