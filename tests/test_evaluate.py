"""task=evaluate: the reported loss / perplexity equal transformers' on the very batches of the split."""

import json
import math
import shutil
import subprocess
import sys

import torch
from omegaconf import OmegaConf
from transformers import Qwen3ForCausalLM

from speedllm.config.schema import ModelConfig
from speedllm.data.loader import build_loader
from speedllm.data.tokenizer import load_tokenizer
from speedllm.models.hf_adapter import hf_config
from speedllm.paths import ASSETS, ROOT

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"


def test_evaluate_matches_transformers_loss(tmp_path):
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), dict(
        name="tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512))
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).eval()
    hf.save_pretrained(tmp_path / "hf")
    for f in DEMO_TOKENIZER.iterdir():
        shutil.copy(f, tmp_path / "hf")

    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={tmp_path}/run", "hardware=cpu",
                           "task=evaluate", "model=hf", f"checkpoint.load_hf={tmp_path}/hf", "data=demo",
                           "evaluate.split=valid", "evaluate.steps=3", "train.micro_batch_size=2", "train.seq_len=64"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "run" / "eval.json").read_text())

    frozen = OmegaConf.load(tmp_path / "run" / "config.yaml")  # the run's own data settings
    loader = build_loader(frozen, "valid", 0, 1, 2, 64, frozen.seed)
    ce, count = 0.0, 0
    with torch.no_grad():
        for _, batch in zip(range(3), loader):
            logits = hf(batch["tokens"]).logits
            ce += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                    reduction="sum").item()
            count += int((batch["labels"] != -100).sum())
    assert result["tokens"] == count == 3 * 2 * 64
    assert abs(result["loss"] - ce / count) <= 1e-5
    assert math.isclose(result["perplexity"], math.exp(ce / count), rel_tol=1e-5)
    assert result["tokens_per_s"] > 0
    assert f"perplexity {result['perplexity']:.2f}" in proc.stdout
