"""task=evaluate: the reported loss / perplexity equal transformers' on the very batches of the split."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.data.loader import build_loader
from speedllm.data.tokenizer import load_tokenizer
from speedllm.paths import ASSETS

pytestmark = pytest.mark.numerics

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"


def test_evaluate_matches_transformers_loss(tmp_path, save_tiny_hf, launch):
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    hf = save_tiny_hf(tmp_path / "hf", vocab_size=len(tok), max_position_embeddings=512, rope_theta=1e6)

    code, out, err = launch(tmp_path / "run", "hardware=cpu", "task=evaluate", "model=hf",
                            f"checkpoint.load_hf={tmp_path}/hf", "data=demo", "evaluate.split=valid",
                            "evaluate.steps=3", "train.micro_batch_size=2", "train.seq_len=64", cwd=tmp_path)
    assert code == 0, err
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
    assert f"perplexity {result['perplexity']:.2f}" in out
