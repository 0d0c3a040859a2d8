"""quant= under tensor parallelism: each of 2 gloo ranks quantizes its own shards as it loads (HF directory and
DCP checkpoint), and the model computes what the single process' quantized model does.

int8_wo / int4_wo: every quantized layer's weight, as the layer computes with it (its forward on an identity
matrix), is exactly the matching slice of the single process' (row-parallel int8 scales are all-reduced over
the ranks; int4 groups lie inside one shard), greedy tokens are identical, and the prefill logits and
task=evaluate's summed loss agree within fp32 summation order (int8) or the bf16 rounding of the int4 kernel's
partial outputs (int4). int8_dyn quantizes each shard's rows and activations by itself: tokens identical, logits
and loss nearer the single process' int8_dyn than that is to fp32. Each rank holds the weight bytes the planner
counts for it. Unquantized, tp2 (its loss vocabulary-parallel) matches the single process within 1e-5. Then
the launched task=generate under tp2 writes the single process' rows.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from test_generate import read_rows
from test_moe_parallel import runtime
from test_quant import GREEDY, PROMPTS

from speedllm.config import compose_config as composed
from speedllm.planner.memory import inference_weight_bytes
from speedllm.quant import QUANTIZED

pytestmark = pytest.mark.distributed

RUNS = [("hf", "int8_wo"), ("hf", "int4_wo"), ("hf", "int8_dyn"), ("dcp", "int8_wo"), ("hf", "none")]
ROWWISE = ("o_proj", "down_proj")


def config(root, source, name, tp):
    from speedllm.config.resolve import adopt_checkpoint_config

    weights = ([f"checkpoint.load={root / 'dcp'}"] if source == "dcp" else
               ["model=hf", f"checkpoint.load_hf={root / 'hf'}"])
    cfg = composed("task=generate", "hardware=cpu", "hardware.dtype=float32", f"run_dir={root}", f"quant={name}", "quant.group_size=32",
                   "parallel=tp2" if tp == 2 else "parallel=single", *weights)
    adopt_checkpoint_config(cfg)
    return cfg


def load(root, source, name, tp):
    from speedllm.generation.load import load_model

    cfg = config(root, source, name, tp)
    rank = torch.distributed.get_rank() if tp == 2 else 0
    return load_model(cfg, runtime(cfg, rank, tp))


@torch.no_grad()
def outputs(model, tp) -> dict:
    """Prefill logits of one prompt, greedy tokens of a batch, each quantized layer's weight [in, out], and the
    bytes of this rank's weights (the int8 per-row scales left out, as the planner leaves them out)."""
    from torch.distributed.tensor import DTensor

    from speedllm.generation.engine import generate_ids

    local = [t.to_local() if isinstance(t, DTensor) else t for n, t in model.state_dict().items()
             if not n.endswith(".scale")]
    weights = {fqn: m.forward(torch.eye(m.in_features)) for fqn, m in model.named_modules()  # forward: no TP hooks
               if fqn.rsplit(".", 1)[-1] in QUANTIZED and not isinstance(getattr(m, "weight", None), DTensor)}
    text = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    ce_sum, _ = model(text[:, :-1], labels=text[:, 1:])  # task=evaluate's loss
    return {"logits": model(torch.tensor([PROMPTS[2]])), "loss": ce_sum,
            "ids": generate_ids(model, PROMPTS, 12, GREEDY, stop_ids=[], pad_id=0, dtype=torch.float32, tp=tp),
            "weights": weights, "bytes": sum(t.numel() * t.element_size() for t in local)}


def _rank(rank, port, root):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for source, name in RUNS:
        torch.save(outputs(load(root, source, name, 2), 2), root / f"{source}_{name}_rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory, save_tiny_hf):
    from speedllm.tasks.convert import hf_to_dcp

    root = tmp_path_factory.mktemp("quant_tp")
    # 4 heads of 16 (2 kv heads), MLP 128: every shard's width is a multiple of group size 32 and of 16 rows
    save_tiny_hf(root / "hf", tokenizer=False, vocab_size=128, hidden_size=64, intermediate_size=128,
                 tie_word_embeddings=False)
    hf_to_dcp(str(root / "hf"), str(root / "dcp"), composed("model=hf", f"checkpoint.load_hf={root / 'hf'}",
                                                            "hardware=cpu", "hardware.dtype=float32", f"run_dir={root}"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, root), nprocs=2)
    return root


@pytest.mark.parametrize("source,name", RUNS)
def test_tp2_quantized_model_computes_the_single_process_quantized_model(source, name, root):
    ranks = [torch.load(root / f"{source}_{name}_rank{r}.pt") for r in range(2)]
    single = outputs(load(root, source, name, 1), 1)
    assert ranks[0]["ids"] == ranks[1]["ids"] == single["ids"]
    diff = (ranks[0]["logits"] - single["logits"]).abs().max()
    loss_diff = abs(ranks[0]["loss"] - single["loss"])
    if name == "none":  # unquantized: the reference for the tolerances below (vocabulary-parallel loss under tp2)
        assert diff <= 1e-5 and loss_diff <= 1e-5 * single["loss"]
        return
    if name == "int8_dyn":
        fp32 = outputs(load(root, source, "none", 1), 1)
        assert 0 < diff < (single["logits"] - fp32["logits"]).abs().max()
        # (a summed loss's quantization errors partly cancel, so tp1's own distance from fp32 is no bound for it)
        assert loss_diff <= 1e-3 * single["loss"]
        return
    cfg = config(root, source, name, 2)
    OmegaConf.resolve(cfg)  # as the launcher does: model=hf reads config.json through interpolations
    planned, _ = inference_weight_bytes(cfg.model, cfg.quant, "float32", tp=2)
    assert ranks[0]["bytes"] == ranks[1]["bytes"] == planned
    assert len(single["weights"]) == 7 * 2
    for fqn, weight_DO in single["weights"].items():
        dim = 0 if fqn.endswith(ROWWISE) else 1  # a row-parallel shard holds input features, a column one outputs
        for r, piece in enumerate(weight_DO.chunk(2, dim)):
            assert torch.equal(ranks[r]["weights"][fqn], piece), (fqn, r)
    assert diff <= (1e-5 if name == "int8_wo" else 1e-2 * single["logits"].abs().max())
    assert loss_diff <= (1e-5 if name == "int8_wo" else 1e-3) * single["loss"]


def test_generate_task_under_tp2_with_int4_writes_the_single_process_rows(hf_dir, tmp_path, launch):
    path, _, _ = hf_dir
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Once upon a time"}\n{"prompt": "The cat"}\n')
    common = ["task=generate", "hardware=cpu", "hardware.dtype=float32", "model=hf", f"checkpoint.load_hf={path}", "quant=int4_wo",
              "quant.group_size=32", f"generate.prompts_file={tmp_path}/prompts.jsonl", "generate.max_new_tokens=8",
              "generate.batch_size=2"]
    for parallel in ("single", "tp2"):
        code, _, err = launch(tmp_path / parallel, *common, f"parallel={parallel}",
                              f"generate.output={tmp_path}/{parallel}.jsonl", cwd=tmp_path)
        assert code == 0, err
    assert read_rows(tmp_path / "tp2.jsonl") == read_rows(tmp_path / "single.jsonl")
