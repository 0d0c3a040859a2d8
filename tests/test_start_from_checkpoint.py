"""Training tasks started from another task's checkpoint (checkpoint.load naming a pretraining or SFT run): the new
run takes the checkpoint's weights (not its optimizer, LR schedule or data position), says so in one line, and its
first step computes with exactly the weights task=generate loads from that checkpoint."""

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_train_loop import TINY, metrics

from speedllm.config import compose_config
from speedllm.config.resolve import adopt_checkpoint_config
from speedllm.data.loader import build_loader
from speedllm.data.prompts import load_prompts
from speedllm.data.tokenizer import load_tokenizer
from speedllm.generation.load import load_model
from speedllm.runtime import Runtime
from speedllm.tasks.grpo import silent_start_notice
from speedllm.train.step import model_inputs

pytestmark = pytest.mark.numerics

SAYS = "starts a new run from its weights (fresh optimizer, LR schedule and data order, step 0)"


def record(prompts, completions, completion_ids, out, **columns):
    """A reward that writes what it scored (prompts, completion ids) to `out`: the share of even token ids."""
    Path(out).write_text(json.dumps({"prompts": prompts, "completion_ids": completion_ids}))
    return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_here):
    """A 2-step pretraining run, then a 2-step SFT run started from it."""
    root = tmp_path_factory.mktemp("start")
    launch_here(root / "pretrain", *TINY, "train.steps=2")
    launch_here(root / "sft", *TINY, "task=sft", "train.steps=2", f"checkpoint.load={root}/pretrain/checkpoints")
    return root


def generate_model(step_dir: Path, run_dir: Path):
    """The model of checkpoint `step_dir` as task=generate resolves and loads it."""
    cfg = compose_config("task=generate", "hardware=cpu", "hardware.dtype=float32", f"checkpoint.load={step_dir}",
                         f"run_dir={run_dir}")
    adopt_checkpoint_config(cfg)
    return load_model(cfg, Runtime()), cfg


def said_once(run_dir: Path, task: str, source: str) -> bool:
    """The run's console output (its launch.log) says once that it starts from a `source` checkpoint."""
    lines = [line for line in (run_dir / "launch.log").read_text().splitlines() if SAYS in line]
    return len(lines) == 1 and f"is a task={source} checkpoint; task={task} starts" in lines[0]


def test_sft_from_a_pretraining_run_starts_fresh_from_its_weights(runs):
    """The SFT run's first loss is the pretraining checkpoint's loss on the SFT run's first batch."""
    assert said_once(runs / "sft", "sft", "pretrain")
    records = metrics(runs / "sft")
    assert [r["step"] for r in records] == [1, 2]
    frozen = OmegaConf.load(runs / "sft" / "config.yaml")
    assert records[0]["lr"] == pytest.approx(frozen.optim.lr / frozen.optim.warmup_steps)  # a fresh schedule
    model, _ = generate_model(runs / "pretrain" / "checkpoints" / "step_00000002", runs / "gen_pretrain")
    t = frozen.train
    loader = build_loader(frozen, "train", 0, 1, t.micro_batch_size, t.seq_len, frozen.seed)
    batches = [next(loader) for _ in range(t.global_batch_size // t.micro_batch_size)]
    with torch.no_grad():
        ce = sum(model(b["tokens"], **model_inputs(b))[0] for b in batches)
    targets = sum(int((b["labels"] >= 0).sum()) for b in batches)
    assert records[0]["loss"] == pytest.approx(float(ce) / targets, rel=1e-5)


def test_grpo_from_an_sft_run_samples_and_scores_with_its_weights(runs, launch_here):
    """`task=grpo checkpoint.load=<sft run>/checkpoints` without the model's overrides (they come from the
    checkpoint): its first step's training forward (entropy over the sampled completions) equals task=generate's
    model of the SFT checkpoint on the same tokens, and its reference model is those weights too (KL 0)."""
    scored = runs / "scored.json"
    launch_here(runs / "grpo", "task=grpo", "hardware=cpu", f"checkpoint.load={runs}/sft/checkpoints",
                "train.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=4", "rl.kl_coef=0.1",
                f"rl.rewards=[{{_target_: test_start_from_checkpoint.record, out: '{scored}'}}]")
    assert said_once(runs / "grpo", "grpo", "sft")
    (first,) = metrics(runs / "grpo")
    assert first["rl/kl"] == 0.0
    model, cfg = generate_model(runs / "sft" / "checkpoints" / "step_00000002", runs / "gen_sft")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    frozen = OmegaConf.load(runs / "grpo" / "config.yaml")
    data = load_prompts(frozen.data.input, tokenizer, 10_000, 4)
    dump = json.loads(scored.read_text())
    entropies = []
    with torch.no_grad():
        for prompt, completion in zip(dump["prompts"], dump["completion_ids"]):
            ids = data.ids[data.prompts.index(prompt)]
            logits = model(torch.tensor([ids + completion]))[0, len(ids) - 1:-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            entropies += (-(logp.exp() * logp).sum(dim=-1)).tolist()
    assert first["rl/entropy"] == pytest.approx(sum(entropies) / len(entropies), abs=1e-5)
    assert first["rl/response_len"] == pytest.approx(sum(map(len, dump["completion_ids"])) / 4)

    # its resume is the same command plus checkpoint.load=<this run>: the model again from the lineage's start
    launch_here(runs / "grpo_resumed", "task=grpo", "hardware=cpu", f"checkpoint.load={runs}/grpo/checkpoints",
                "train.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=4", "rl.kl_coef=0.1",
                f"rl.rewards=[{{_target_: test_start_from_checkpoint.record, out: '{scored}'}}]")
    assert "resumed from" in (runs / "grpo_resumed" / "launch.log").read_text()
    assert [r["step"] for r in metrics(runs / "grpo_resumed")] == [2]


def test_distill_and_dpo_from_our_checkpoints(runs, launch_here, tmp_path):
    """Distillation of the SFT checkpoint into a student started from that same checkpoint: the first step's
    divergence is 0 (student = teacher). DPO from the SFT run: its reference is the policy's starting weights
    (first loss log 2), and its first gradient norm is that of task=generate's model of the SFT checkpoint."""
    launch_here(tmp_path / "distill", *TINY, "task=distill", "train.steps=1",
                f"checkpoint.load={runs}/sft/checkpoints", f"distill.teacher={runs}/sft/checkpoints")
    assert said_once(tmp_path / "distill", "distill", "sft")
    assert abs(metrics(tmp_path / "distill")[0]["loss"]) < 1e-6
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "chosen": f"{a + 2}.", "rejected": f"{a}."})
                             + "\n" for a in range(4)))
    launch_here(tmp_path / "dpo", *TINY, "task=dpo", "data.format=pairs", f"data.input={pairs}", "train.seq_len=64",
                "train.steps=1", f"checkpoint.load={runs}/sft/checkpoints")
    assert said_once(tmp_path / "dpo", "dpo", "sft")
    (first,) = metrics(tmp_path / "dpo")
    # the policy's log-probabilities come from the loss kernel with its gradient, the reference's from the no-grad
    # one: equal weights, sums in another order (1e-7)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["reward_margin"] == pytest.approx(0, abs=1e-6)

    # DPO's gradient where policy = reference: -beta / 2 * (grad log p(chosen) - grad log p(rejected)) per pair
    model, _ = generate_model(runs / "sft" / "checkpoints" / "step_00000002", tmp_path / "gen")
    frozen = OmegaConf.load(tmp_path / "dpo" / "config.yaml")
    t = frozen.train
    loader = build_loader(frozen, "train", 0, 1, t.micro_batch_size, t.seq_len, frozen.seed)
    rows = [(tokens, labels) for b in (next(loader) for _ in range(t.global_batch_size // t.micro_batch_size))
            for tokens, labels in zip(b["tokens"].flatten(0, 1), b["labels"].flatten(0, 1))]
    logp = torch.stack([-model(tokens[None], labels=labels[None])[0] for tokens, labels in rows]).view(-1, 2)
    margin = frozen.dpo.beta * ((logp[:, 0] - logp[:, 0].detach()) - (logp[:, 1] - logp[:, 1].detach()))
    (-torch.nn.functional.logsigmoid(margin).mean()).backward()
    grads = {id(p): p.grad for p in model.parameters() if p.grad is not None}.values()
    assert first["grad_norm"] == pytest.approx(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))), rel=1e-4)


def test_grpo_from_random_weights_says_it_learns_nothing(tmp_path, launch_here):
    """`python launch.py task=grpo` alone: random weights answer no prompt, every group's rewards are equal, and
    after its first steps (here both) the run says so in one line naming the two-command recipe (loss and
    grad_norm are 0)."""
    launch_here(tmp_path, *TINY, "task=grpo", "train.steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
                "rl.max_new_tokens=3")
    records = metrics(tmp_path)
    assert all(r["rl/zero_adv_groups"] == 1 and r["loss"] == 0 and r["grad_norm"] == 0 for r in records)
    lines = [line for line in (tmp_path / "launch.log").read_text().splitlines() if "nothing is learned" in line]
    assert lines == [silent_start_notice(2)] and "task=grpo checkpoint.load=<that run>/checkpoints" in lines[0]
