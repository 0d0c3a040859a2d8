"""task=dpo on preference pairs: the step-1 loss against one computed from transformers + peft log-probs, reward
accuracy on an easy synthetic preference (correct vs wrong sums), the pair layouts and their one-line errors."""

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_finetune_lora import config
from test_hf import save_hf
from test_train_loop import TINY, metrics
from test_train_sft import assistant_targets

from speedllm.data.pairs import load_pairs, to_pair
from speedllm.data.tokenizer import load_tokenizer
from speedllm.errors import UserError
from speedllm.runtime import Runtime
from speedllm.tasks.dpo import run

DPO = ["task=dpo", "data.format=pairs", "train.seq_len=96", "optim.warmup_steps=0", "optim.schedule=constant"]
PROMPT, CHOSEN, REJECTED = "What is 2 + 3?", "2 + 3 = 5.", "2 + 3 = 7."
LAYOUTS = [  # the same pair in every layout data.format=pairs reads
    {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
    {"instruction": PROMPT, "input": "", "chosen": CHOSEN, "rejected": REJECTED},
    {"conversations": [{"from": "human", "value": PROMPT}], "chosen": {"from": "gpt", "value": CHOSEN},
     "rejected": {"from": "gpt", "value": REJECTED}},
    {"chosen": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": CHOSEN}],
     "rejected": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": REJECTED}]},
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def arithmetic_pairs(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        pairs.append({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}.",
                      "rejected": f"{a} + {b} = {wrong}."})
    return pairs


def test_every_layout_reads_as_the_same_pair():
    for i, record in enumerate(LAYOUTS):
        assert to_pair(record, f"x:{i}") == ([{"role": "user", "content": PROMPT}], CHOSEN, REJECTED)


def test_pair_errors_name_the_line_and_the_fix(tmp_path):
    tokenizer = load_tokenizer(config(tmp_path, *TINY).data.tokenizer)
    empty = write_jsonl(tmp_path / "empty.jsonl", [LAYOUTS[0], {"prompt": PROMPT, "chosen": CHOSEN, "rejected": ""}])
    with pytest.raises(UserError, match=r"empty\.jsonl:2: empty rejected reply — give every pair a non-empty"):
        load_pairs(str(empty), tokenizer, 96)
    long = write_jsonl(tmp_path / "long.jsonl", [{**LAYOUTS[0], "prompt": "word " * 200}])
    with pytest.raises(UserError, match=r"long\.jsonl:1: the prompt is \d+ tokens but train.seq_len=96 — raise"):
        load_pairs(str(long), tokenizer, 96)


def logps(model, messages_list, tokenizer) -> torch.Tensor:
    """Summed log-probabilities of each conversation's assistant reply, from a transformers model's logits."""
    out = []
    for messages in messages_list:
        ids = torch.tensor([tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]])
        with torch.no_grad():
            logp = F.log_softmax(model(ids).logits[0].double(), dim=-1)
        out.append(sum(logp[t, ids[0, t + 1]] for t in assistant_targets(ids[0], tokenizer)))
    return torch.stack(out)


def test_step_one_loss_equals_transformers_peft_computation(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf_dir = save_hf("dense_tied", tmp_path / "hf", max_shard_size="1MB", vocab_size=8192)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir).eval(), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    pairs = arithmetic_pairs(4)
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    cfg = config(tmp_path / "run", *DPO, "model=hf", f"checkpoint.load_hf={hf_dir}", f"data.input={data}",
                 "finetune=lora", "finetune.rank=4", "finetune.alpha=8", "finetune.targets=[q_proj,v_proj,down_proj]",
                 f"finetune.adapter={tmp_path / 'adapter'}", "train.steps=1", "train.micro_batch_size=2",
                 "train.global_batch_size=4", "dpo.beta=0.5")
    run(cfg, Runtime())
    (ours,) = metrics(Path(cfg.run_dir))

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    sides = [[[{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p[side]}] for p in pairs]
             for side in ("chosen", "rejected")]
    policy = [logps(peft_model.eval(), s, tokenizer) for s in sides]
    with peft_model.disable_adapter():
        reference = [logps(peft_model, s, tokenizer) for s in sides]
    margin = 0.5 * ((policy[0] - reference[0]) - (policy[1] - reference[1]))
    expected = -F.logsigmoid(margin).mean().item()
    assert margin.abs().min() > 1e-3  # the adapter makes policy and reference differ
    assert ours["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert ours["reward_accuracy"] == pytest.approx((margin > 0).double().mean().item())


def test_reward_accuracy_rises_above_0_9_on_an_easy_preference(tmp_path):
    """Eight pairs seen every step (batch 8): the policy learns to prefer the correct sums of its pairs."""
    data = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(8, seed=1))
    cfg = config(tmp_path / "run", *TINY, *DPO, f"data.input={data}", "train.seq_len=64", "finetune=lora",
                 "finetune.rank=8", "train.steps=5", "train.micro_batch_size=8", "train.global_batch_size=8",
                 "optim.lr=5e-3", "dpo.beta=0.1")
    run(cfg, Runtime())
    records = metrics(Path(cfg.run_dir))
    assert records[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # B = 0: policy = reference, loss log 2
    assert records[-1]["reward_accuracy"] > 0.9 and records[-1]["reward_margin"] > 0, records


@pytest.mark.parametrize("overrides, message", [
    (["task=dpo"], "task=dpo needs data.input=<json/jsonl of prompt/chosen/rejected pairs>"),
    (["task=dpo", "data.input=x.jsonl", "parallel=pp2"], "task=dpo does not run on pipeline stages"),
    (["task=sft", "finetune=lora", "finetune.targets=[q_proj,lm_head]"], "finetune.targets=['q_proj', 'lm_head']: "
     "['lm_head'] not adaptable; pick from q_proj"),
    (["task=sft", "finetune.adapter=/nowhere"], "finetune.adapter=/nowhere needs adapters to load into; add "
     "finetune=lora"),
    (["task=sft", "finetune=qlora", "parallel=pp2"], "finetune=qlora shards its NF4 base with FSDP2 only"),
])
def test_finetune_and_dpo_settings_are_validated_before_launch(overrides, message):
    from omegaconf import open_dict

    from speedllm.config import compose_config as composed
    from speedllm.config.resolve import resolve_layout
    from speedllm.config.validate import validate

    cfg = composed("hardware=cpu", "hardware.dtype=float32", *overrides)
    with open_dict(cfg):
        world, nproc = resolve_layout(cfg)
        with pytest.raises(UserError) as err:
            validate(cfg, world, nproc)
    assert message in str(err.value) and "\n" not in str(err.value)
