"""Every task on the hybrid family (Qwen3.5 dense and MoE: Gated DeltaNet layers beside gated attention) through
launch.py, each held against an independent reference: transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM
on the same weights (greedy tokens, losses, log-probabilities), peft over the transformers model (a LoRA adapter on
the Gated DeltaNet projections), DPO's and GRPO's own identities at step one, and the planner's bytes (dryrun)."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from test_chat import reference_reply
from test_generate import hf_greedy, stop_ids
from test_serve import serving, text_of

from speedllm.data.loader import build_loader
from speedllm.data.tokenizer import load_tokenizer
from speedllm.paths import ASSETS

pytestmark = pytest.mark.numerics

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
# 128 wide so that QLoRA's NF4 blocks (64 x 256 weights) divide the attention and Gated DeltaNet projections
TEXT = dict(vocab_size=8192, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, intermediate_size=256, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
RUN = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=2", "train.log_every=1",
       "train.eval_every=0", "generate.num_samples=0", "optim.warmup_steps=0", "optim.schedule=constant",
       "logging.progress_bar=false"]
GDN = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """{"dense", "moe"}: random tiny Qwen3.5 directories saved by transformers, the demo tokenizer beside them."""
    import transformers

    root = tmp_path_factory.mktemp("qwen3_5")
    out = {}
    for kind, cls, config in (("dense", transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**TEXT)),
                              ("moe", transformers.Qwen3_5MoeForCausalLM,
                               transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE))):
        torch.manual_seed(3)
        model = cls(config)
        with torch.no_grad():  # off the init (norms at zero, dt_bias at one) so every weight matters
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        model.save_pretrained(root / kind)
        for file in DEMO_TOKENIZER.iterdir():
            shutil.copy(file, root / kind / file.name)
        out[kind] = root / kind
    return out


def transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def first_batch_loss(run_dir, model):
    """transformers' mean cross-entropy on the first training batch of the run's own frozen data settings."""
    frozen = OmegaConf.load(run_dir / "config.yaml")
    batch = next(build_loader(frozen, "train", 0, 1, frozen.train.micro_batch_size, frozen.train.seq_len,
                              frozen.seed))
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100).item()


def test_pretrain_convert_and_generate(tmp_path, launch):
    """Pretrain the dense config group from scratch, export to HF: transformers loads the export, and
    task=generate on the checkpoint gives transformers' greedy tokens on it."""
    code, _, err = launch(tmp_path / "pt", "task=pretrain", "model=qwen3_5_tiny", *RUN, "train.steps=2",
                          "optim.lr=1e-2", "checkpoint.every=2")
    assert code == 0, err[-3000:]
    assert records(tmp_path / "pt")[0]["loss"] > 0
    code, _, err = launch(tmp_path / "cv", "task=convert", f"checkpoint.load={tmp_path}/pt/checkpoints",
                          "convert.to=hf", f"convert.out={tmp_path}/hf")
    assert code == 0, err[-3000:]
    code, _, err = launch(tmp_path / "gen", "task=generate", f"checkpoint.load={tmp_path}/pt/checkpoints",
                          "generate.prompt=ROMEO:", "generate.max_new_tokens=8",
                          f"generate.output={tmp_path}/out.jsonl")
    assert code == 0, err[-3000:]
    row = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    hf = transformers_model(tmp_path / "hf")
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    assert row["completion_ids"] == hf_greedy(hf, [tok.encode("ROMEO:", add_special_tokens=False)], 8,
                                              eos=stop_ids(tok))[0]


@pytest.fixture(scope="module")
def lora_run(dirs, tmp_path_factory, launch):
    """finetune=lora SFT on the dense directory, the Gated DeltaNet projections among the targets, exported as a
    PEFT adapter."""
    root = tmp_path_factory.mktemp("lora")
    code, _, err = launch(root / "run", "task=sft", "model=hf", f"checkpoint.load_hf={dirs['dense']}", *RUN,
                           "data.packing=false", "train.steps=3", "optim.lr=1e-2", "finetune=lora", "finetune.rank=4",
                           "finetune.alpha=8",
                           "checkpoint.every=3")
    assert code == 0, err[-3000:]
    code, _, err = launch(root / "cv", "task=convert", f"checkpoint.load={root}/run/checkpoints", "convert.to=peft",
                           f"convert.out={root}/peft")
    assert code == 0, err[-3000:]
    return root


def test_sft_lora_on_gdn_projections_loads_into_peft_with_our_logits(lora_run, dirs):
    from peft import PeftModel

    from speedllm.checkpoint.adapters import load_base
    from speedllm.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from speedllm.runtime import Runtime
    from speedllm.train.build import build_model
    from speedllm.train.optimizer import build_optimizer

    config = json.loads((lora_run / "peft" / "adapter_config.json").read_text())
    assert set(GDN) <= set(config["target_modules"])
    # step 1 starts from the base (B = 0): transformers' loss on the same batch
    base = transformers_model(dirs["dense"])
    assert records(lora_run / "run")[0]["loss"] == pytest.approx(first_batch_loss(lora_run / "run", base), rel=1e-5)

    cfg = OmegaConf.load(lora_run / "run" / "config.yaml")
    ckpt = latest_checkpoint(cfg.checkpoint.dir)
    pm = build_model(cfg, Runtime())
    load_base(pm.parts, cfg, ckpt)
    load_checkpoint(ckpt, pm.module, build_optimizer(pm.module, cfg.optim))
    tokens = torch.randint(0, 8192, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = pm.eval()(tokens)
        base_logits = base(tokens).logits
        theirs = PeftModel.from_pretrained(base, lora_run / "peft").eval()(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - base_logits).abs().max().item() > 1e-2  # the adapters changed the model


def test_qlora_on_gdn_projections_starts_at_the_nf4_base(lora_run, dirs, tmp_path, launch):
    """QLoRA over the attention and Gated DeltaNet projections: the first loss is the base model's up to NF4's
    rounding, and training lowers it. (in_proj_a / in_proj_b, 4 x 128, are not whole NF4 blocks: refused.)"""
    base = ["task=sft", "model=hf", f"checkpoint.load_hf={dirs['dense']}", *RUN, "data.packing=false", "optim.lr=1e-2",
            "finetune=qlora",
            "checkpoint.save_final=false"]
    code, _, err = launch(tmp_path / "bad", *base)
    assert code == 2 and "in_proj_b.weight [4, 128] does not split into whole NF4 blocks" in err
    code, _, err = launch(tmp_path / "run", *base, "train.steps=3",
                          "finetune.targets=[q_proj,in_proj_qkv,in_proj_z,out_proj]")
    assert code == 0, err[-3000:]
    losses = [r["loss"] for r in records(tmp_path / "run")]
    assert losses[0] == pytest.approx(records(lora_run / "run")[0]["loss"], rel=0.02)
    assert losses[-1] < losses[0]


def test_dpo_step_one_is_log_two(dirs, tmp_path, launch):
    """Policy = reference at step one: loss ln 2, zero margin; then the policy moves."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "chosen": f"{2 * a}.",
                                         "rejected": f"{2 * a + 1}."}) + "\n" for a in range(6)))
    code, _, err = launch(tmp_path / "run", "task=dpo", "model=hf", f"checkpoint.load_hf={dirs['dense']}", *RUN,
                          "data.format=pairs", f"data.input={pairs}", "finetune=lora", "optim.lr=1e-2",
                          "train.steps=2", "checkpoint.save_final=false")
    assert code == 0, err[-3000:]
    first, second = records(tmp_path / "run")
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5) and abs(first["reward_margin"]) <= 1e-5
    assert abs(second["reward_margin"]) > 1e-3


def test_grpo_moe_replays_the_rollout_routes(tmp_path, launch):
    """GRPO on the MoE group: the rollout's log-probabilities (recurrent decode through the per-layer cache) equal
    the training forward's (chunked, the rollout's experts replayed)."""
    code, _, err = launch(tmp_path / "run", "task=grpo", "model=qwen3_5_moe_tiny", *RUN, "train.steps=2",
                          "rl.prompts_per_step=2", "rl.group_size=3", "rl.max_new_tokens=5", "rl.temperature=1.0",
                          "checkpoint.save_final=false")
    assert code == 0, err[-3000:]
    for r in records(tmp_path / "run"):
        assert r["rl/logprob_diff"] <= 1e-5 and r["rl/changed_routes"] == 0 and "rl/replayed_routes" in r


def test_distill_hybrid_student_from_hybrid_teacher(dirs, tmp_path, launch):
    """The first step's KL and CE equal torch's on the two transformers models' logits."""
    code, _, err = launch(tmp_path / "run", "task=distill", "model=hf", f"checkpoint.load_hf={dirs['dense']}",
                          f"distill.teacher={dirs['moe']}", *RUN, "data=sft_demo", "data.packing=false",
                          "train.steps=1", "optim.lr=1e-9", "optim.min_lr=0", "checkpoint.save_final=false")
    assert code == 0, err[-3000:]
    (record,) = records(tmp_path / "run")
    frozen = OmegaConf.load(tmp_path / "run" / "config.yaml")
    batch = next(build_loader(frozen, "train", 0, 1, 2, 64, frozen.seed))
    with torch.no_grad():
        s, t = (transformers_model(dirs[k])(batch["tokens"]).logits for k in ("dense", "moe"))
    keep = batch["labels"] != -100
    assert record["distill/ce"] == pytest.approx(F.cross_entropy(s[keep], batch["labels"][keep]).item(), rel=1e-5)
    kl = F.kl_div(F.log_softmax(s[keep], -1), F.log_softmax(t[keep], -1), reduction="batchmean", log_target=True)
    assert record["distill/kl"] == pytest.approx(kl.item(), rel=1e-5)


def test_evaluate_loss_equals_transformers(dirs, tmp_path, launch):
    code, out, err = launch(tmp_path / "run", "task=evaluate", "model=hf", f"checkpoint.load_hf={dirs['moe']}",
                            "data=demo", "evaluate.split=valid", "evaluate.steps=2", "train.micro_batch_size=2",
                            "train.seq_len=64")
    assert code == 0, err[-3000:]
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    frozen = OmegaConf.load(tmp_path / "run" / "config.yaml")
    hf = transformers_model(dirs["moe"])
    ce = 0.0
    with torch.no_grad():
        for _, batch in zip(range(2), build_loader(frozen, "valid", 0, 1, 2, 64, frozen.seed)):
            ce += F.cross_entropy(hf(batch["tokens"]).logits.flatten(0, 1), batch["labels"].flatten(),
                                  reduction="sum").item()
    assert result["tokens"] == 2 * 2 * 64 and result["loss"] == pytest.approx(ce / (2 * 2 * 64), abs=1e-5)


def test_harness_loglikelihoods_equal_transformers(dirs):
    """lm-eval's loglikelihood requests through our backend on right-padded batches of unequal lengths."""
    from speedllm.generation.harness import SpeedLM
    from speedllm.models.hf_adapter import from_hf_state_dict, model_config_from_hf
    from speedllm.models.config import ModelConfig
    from speedllm.models.qwen3 import Qwen3

    hf = transformers_model(dirs["dense"])
    tok = load_tokenizer(str(dirs["dense"]))
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "t", **model_config_from_hf(hf.config.to_dict())})
    ours = Qwen3(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    lm = SpeedLM(ours, tok, max_length=256, batch_size=3, dtype=torch.float32)
    pairs = [("The king of Denmark is", " Hamlet"), ("Romeo loves", " Juliet and the night"), ("To be, or", " not")]
    requests = [((c, t), tok.encode(c, add_special_tokens=False), tok.encode(t, add_special_tokens=False))
                for c, t in pairs]
    got = lm._loglikelihood_tokens(requests)
    for (_, context, target), (logprob, _) in zip(requests, got):
        ids = torch.tensor([context + target])
        with torch.no_grad():
            logp = hf(ids).logits.log_softmax(-1)[0, len(context) - 1:-1]
        assert logprob == pytest.approx(logp.gather(-1, torch.tensor(target)[:, None]).sum().item(), abs=1e-4)


def test_chat_reply_is_transformers_greedy(dirs, tmp_path, launch_py):
    tok = load_tokenizer(str(dirs["dense"]))
    proc = launch_py([f"hydra.run.dir={tmp_path}/run", "task=chat", "model=hf", f"checkpoint.load_hf={dirs['dense']}",
                      "hardware=cpu", "hardware.dtype=float32", "generate.max_new_tokens=8"], tmp_path,
                     input="ROMEO:\n/exit\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reply = proc.stdout.split("assistant>", 1)[1].split("you>", 1)[0]
    expected = reference_reply(transformers_model(dirs["dense"]), tok, [{"role": "user", "content": "ROMEO:"}])
    assert reply.strip() == expected.strip() and expected.strip()


def test_serve_continuous_batching_equals_transformers(dirs):
    """Three rows, seven clients with prompts and budgets of different lengths: requests wait, join rows as
    others leave, and each answer is transformers' greedy one."""
    tok = load_tokenizer(str(dirs["dense"]))
    hf = transformers_model(dirs["dense"])
    prompts = ["ROMEO:", "JULIET:\nO", "KING: My lord, the night", "Hamlet", "First Citizen:\nBefore we proceed",
               "LADY", "MERCUTIO: A plague"]
    budgets = [5, 14, 9, 3, 11, 7, 12]
    expected = [text_of(tok, hf_greedy(hf, [tok.encode(p, add_special_tokens=False)], n, eos=stop_ids(tok))[0])
                for p, n in zip(prompts, budgets)]
    with serving(dirs["dense"], "serve.max_batch=3") as (_, _, client):
        def ask(i):
            reply = client.completions.create(model="tiny-qwen3", prompt=prompts[i], temperature=0,
                                              max_tokens=budgets[i])
            return reply.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, range(len(prompts)))) == expected


def test_plan_and_dryrun_agree_for_a_hybrid_model(tmp_path, launch):
    """task=plan on a published size ranks the layouts hybrid models accept (tp2 among them) and refuses the
    others; a dryrun rank of the MoE group under FSDP holds the planner's exact bytes; the planner's cache bytes are
    what the engine allocates, and a Gated DeltaNet layer's share does not grow with the length."""
    from speedllm.config import compose_config
    from speedllm.generation.batching import new_slot_cache
    from speedllm.models.kv_cache import cache_bytes

    code, out, err = launch(tmp_path / "plan", "task=plan", "model=qwen3_next_80b_a3b", "hardware=h100",
                            "launcher.nproc_per_node=8", "train.seq_len=4096", "train.global_batch_size=64")
    assert code == 0, err[-3000:]
    costed = [line for line in out.splitlines() if line[:3].strip().isdigit() and " tp" in line]
    assert costed and any(" tp2 " in line for line in costed), out  # GDN layers split by heads over tp
    assert "parallel.tp=4 does not divide num_key_value_heads=2 of model qwen3_next_80b_a3b" in out
    code, out, err = launch(tmp_path / "dry", "task=dryrun", "model=qwen3_5_moe_tiny", "parallel=fsdp2")
    assert code == 0, err[-3000:]
    assert "= task=plan's exact bytes" in out

    m = compose_config("model=qwen3_5_moe_tiny").model
    for length in (16, 32):
        cache = new_slot_cache(m, 3, length, torch.float32, "cpu")
        assert cache_bytes(m, 3, length, 4) == sum(t.nbytes for t in (cache.k, cache.v, cache.conv,
                                                                               cache.state))
    attention_kv = 2 * 1 * m.num_key_value_heads * m.head_dim * 4  # one attention layer, fp32, per token
    assert cache_bytes(m, 1, 64, 4) - cache_bytes(m, 1, 32, 4) == 32 * attention_kv
