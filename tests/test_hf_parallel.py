"""An HF directory loaded straight into parallel layouts, and exported from a parallel run, through the launcher.

First-step loss of `task=pretrain model=hf checkpoint.load_hf=<dir>` equals transformers' loss on the same
batches (single process), and FSDP2 / TP2 / PP2 runs equal the single process (the three on one set of 2 ranks,
through the launcher's steps: conftest's launch_ranks). A TP2 x PP2 run through launch.py (4 ranks under torch's
elastic agent), converted to HF, gives in transformers the logits of our model loaded from that checkpoint.
"""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.distributed

RUN = ["task=pretrain", "model=hf", "hardware=cpu", "train.steps=1", "train.seq_len=32", "train.micro_batch_size=2",
       "train.global_batch_size=4", "train.log_every=1", "train.eval_every=0", "logging.progress_bar=false",
       "logging.tensorboard=false", "generate.num_samples=0"]
LAYOUTS = ["fsdp2", "tp2", "pp2"]


def first_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r["step"] == 1 and "split" not in r)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, save_tiny_hf):
    """Tiny tied-embedding Qwen3 over the demo tokenizer's 8192 ids, saved by transformers in several shards."""
    path = tmp_path_factory.mktemp("hf")
    save_tiny_hf(path, vocab_size=8192, tie_word_embeddings=True, max_shard_size="300KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory, launch_here):
    run_dir = tmp_path_factory.mktemp("single")
    launch_here(run_dir, *RUN, f"checkpoint.load_hf={hf_dir}", "checkpoint.save_final=false")
    return run_dir


@pytest.fixture(scope="module")
def layouts(hf_dir, tmp_path_factory, launch_ranks):
    root = tmp_path_factory.mktemp("layouts")
    launch_ranks(2, {root / parallel: [*RUN, f"parallel={parallel}", f"checkpoint.load_hf={hf_dir}",
                                       "checkpoint.save_final=false"] for parallel in LAYOUTS})
    return root


def test_single_process_first_loss_is_transformers_loss(hf_dir, single):
    from transformers import AutoModelForCausalLM

    from speedllm.data.loader import build_loader

    cfg = OmegaConf.load(single / "config.yaml")
    loader = iter(build_loader(cfg, "train", 0, 1, 2, 32, cfg.seed))
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ce_sum, count = 0.0, 0
    with torch.no_grad():
        for _ in range(2):  # global batch 4 = 2 micro-batches of 2
            batch = next(loader)
            logits = reference(batch["tokens"]).logits
            ce_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                        ignore_index=-100, reduction="sum").item()
            count += (batch["labels"] != -100).sum().item()
    assert abs(first_loss(single) - ce_sum / count) <= 2e-5


@pytest.mark.parametrize("parallel", LAYOUTS)
def test_parallel_layouts_load_hf_to_the_single_process_loss(parallel, single, layouts):
    assert abs(first_loss(layouts / parallel) - first_loss(single)) <= 2e-5


def test_tp2_pp2_checkpoint_exports_to_transformers(hf_dir, single, tmp_path, launch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoModelForCausalLM

    from speedllm.checkpoint.dcp import _quiet_dcp
    from speedllm.models.qwen3 import Qwen3
    from speedllm.tasks.convert import dcp_to_hf

    code, out, err = launch(tmp_path / "train", *RUN, "parallel=tp2_pp2", f"checkpoint.load_hf={hf_dir}")
    assert code == 0, out[-3000:] + err[-3000:]
    checkpoint = tmp_path / "train" / "checkpoints" / "step_00000001"
    saved = OmegaConf.load(checkpoint / "config.yaml")
    assert abs(first_loss(tmp_path / "train") - first_loss(single)) <= 2e-5
    saved.convert.max_shard_size = "300KB"  # task=convert in this process (the launcher's path: test_hf.py)
    dcp_to_hf(str(checkpoint), str(tmp_path / "hf"), saved)

    ours = Qwen3(saved.model)
    state = {"model": get_model_state_dict(ours)}
    with _quiet_dcp():  # a single process reading a 4-rank checkpoint, on purpose
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    set_model_state_dict(ours, state["model"])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported(tokens).logits - ours.eval()(tokens)).abs().max().item() <= 1e-6
    # the run trained the weights it loaded: the export is not the original
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert not torch.equal(original.model.norm.weight, exported.model.norm.weight)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
