"""HF directories as transformers writes them, loaded the way the docs say (`task=generate model=hf
checkpoint.load_hf=<dir>`) through launch.py: each config.json variant transformers' save_pretrained writes for
Qwen3 / Qwen3-MoE (scaled RoPE as rope_parameters: yarn, linear, dynamic; tied or untied; MoE; weights and the
dtype field in bf16; layer_types and the sliding-window fields) gives transformers' greedy tokens, past the
native length for the scaled RoPEs, and trains (task=sft) from it."""

import json

import pytest
import torch
from test_generate import hf_greedy, read_rows, stop_ids
from test_hf import DEMO_TOKENIZER, save_hf

from speedllm.data.tokenizer import load_tokenizer

pytestmark = [pytest.mark.numerics, pytest.mark.slow]

NATIVE = 32  # the length the RoPE was trained for; generation goes to 3 + 40 positions
VARIANTS = {
    "yarn": ("dense_tied", dict(max_position_embeddings=4 * NATIVE, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": NATIVE, "rope_theta": 10000.0})),
    "linear": ("dense_tied", dict(max_position_embeddings=4 * NATIVE, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    # dynamic NTK scales only past max_position_embeddings: generation runs up to factor x that
    "dynamic": ("dense_untied", dict(max_position_embeddings=NATIVE, rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})),
    "moe_bf16": ("moe", dict(max_position_embeddings=4 * NATIVE, dtype=torch.bfloat16)),
}


def saved(variant, path):
    kind, overrides = VARIANTS[variant]
    dtype = overrides.pop("dtype", torch.float32)
    vocab = len(load_tokenizer(str(DEMO_TOKENIZER)))
    return save_hf(kind, path, dtype=dtype, vocab_size=vocab, **overrides)


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_from_a_transformers_dir_gives_its_greedy_tokens(variant, tmp_path, launch):
    from transformers import AutoModelForCausalLM

    path = saved(variant, tmp_path / variant)
    config = json.loads((path / "config.json").read_text())
    assert "use_sliding_window" in config  # as transformers writes it (dense: layer_types too)
    if variant == "moe_bf16":
        assert config["dtype"] == "bfloat16"
    code, out, err = launch(tmp_path / "run", "task=generate", "model=hf", f"checkpoint.load_hf={path}",
                            "generate.prompt=ROMEO:", "generate.max_new_tokens=40",
                            f"generate.output={tmp_path}/out.jsonl", cwd=tmp_path)
    assert code == 0, err
    (row,) = read_rows(tmp_path / "out.jsonl")
    tok = load_tokenizer(str(path))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_greedy(reference, [tok.encode("ROMEO:", add_special_tokens=False)], 40, eos=stop_ids(tok))[0]
    assert row["completion_ids"] == expected
    assert len(expected) == 40  # past the native length: 3 prompt tokens + 40 > 32


def test_sft_steps_from_a_yarn_dir(tmp_path, launch):
    path = saved("yarn", tmp_path / "yarn")
    code, out, err = launch(tmp_path / "run", "task=sft", "model=hf", f"checkpoint.load_hf={path}",
                            "train.steps=2", "train.log_every=1", "train.seq_len=64", "train.micro_batch_size=2",
                            "train.global_batch_size=2", "train.eval_every=0", "generate.num_samples=0",
                            cwd=tmp_path)
    assert code == 0, err
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "split" not in json.loads(line)]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)


def test_sliding_window_dir_is_refused_in_one_line(tmp_path, launch):
    path = saved("yarn", tmp_path / "sw")
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16,
                  layer_types=["sliding_attention"] * config["num_hidden_layers"])
    (path / "config.json").write_text(json.dumps(config))
    code, out, err = launch(tmp_path / "run", "task=generate", "model=hf", f"checkpoint.load_hf={path}",
                            "generate.prompt=ROMEO:", cwd=tmp_path)
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and "sliding-window attention" in err and "internal" not in err
