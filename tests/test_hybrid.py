"""The hybrid Qwen family (Qwen3.5 dense and MoE, Qwen3-Next) against transformers' own models, at odd tiny sizes.

Logits within 1e-5 relative in fp32; a prefill then one-token decode through our per-layer cache, with left
padding and under continuous batching, equals transformers' greedy generation; HF -> DCP -> HF through
task=convert keeps a release directory (vision tower, MTP tensors, config.json) bit for bit and transformers
loads it with the same logits; task=generate on a Qwen3-Next directory and pretrain on the tiny config groups
through the launcher.
"""

import json
import shutil
import threading

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from speedllm.config import compose_config
from speedllm.generation.batching import Batcher, Request
from speedllm.generation.engine import generate_ids, new_cache
from speedllm.generation.sampling import Sampling
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, model_config_from_hf
from speedllm.models.qwen3 import Qwen3
from speedllm.paths import ASSETS

pytestmark = pytest.mark.numerics

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
# odd sizes: 3 query heads over 1 kv head, 6 GDN value heads on 2 key heads (groups of 3), rotary 6 of 24 dims
TEXT = dict(vocab_size=101, hidden_size=44, num_hidden_layers=5, num_attention_heads=3, num_key_value_heads=1,
            head_dim=24, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=10,
            linear_value_head_dim=14, rms_norm_eps=1e-6, tie_word_embeddings=False)
EXPERTS = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28)
KINDS = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(intermediate_size=72)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", EXPERTS),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(intermediate_size=72, mlp_only_layers=[2], norm_topk_prob=False, **EXPERTS)),
}


def perturb(model, seed):
    """Every weight moved off its init (norms, A_log and dt_bias included), under `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.03)
    return model.eval()


def hf_model(kind, seed=0, **overrides):
    import transformers

    cls, config_cls, extra = KINDS[kind]
    config = getattr(transformers, config_cls)(**{**TEXT, **extra, **overrides})
    torch.manual_seed(seed)
    return perturb(getattr(transformers, cls)(config), seed)


def ours_for(hf, ops="cpu"):
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "t", **model_config_from_hf(hf.config.to_dict())})
    ours = Qwen3(cfg, ops=ops).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return ours


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_loss_and_grads_match_transformers(kind):
    hf, tokens = hf_model(kind), torch.randint(0, TEXT["vocab_size"], (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the cpu op set (hardware=cpu's)
        assert relative_error(ours_for(hf)(tokens), hf(tokens).logits) <= 1e-5
    ours = ours_for(hf, "reference")  # gradients of the plain-torch ops (the cpu kernels' own tests hold theirs)
    out = hf(tokens, labels=tokens)
    out.loss.backward()
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
    ce_sum, _ = ours(tokens, labels=labels)
    (ce_sum / (labels != -100).sum()).backward()
    assert abs(ce_sum.item() / (labels != -100).sum().item() - out.loss.item()) <= 1e-5
    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ours.cfg)
    # relative to the model's largest gradient: dt_bias / A_log gradients are sums of tiny terms that cancel
    scale = max(g.abs().max() for g in hf_grads.values())
    for name, param in ours.named_parameters():
        if name in hf_grads:  # (the router's aux loss is not in transformers' loss without output_router_logits)
            assert (param.grad - hf_grads[name]).abs().max() <= 1e-5 * scale, name


def test_packed_documents_restart_the_conv_and_the_state():
    """Two documents packed in a row compute what each computes alone (conv window and rule state restart)."""
    ours = ours_for(hf_model("qwen3_5", seed=2))
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, TEXT["vocab_size"], (1, n), generator=gen) for n in (37, 30)]
    document_ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    positions = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    with torch.no_grad():
        packed = ours(torch.cat(docs, dim=1), position_ids=positions, document_ids=document_ids)
        alone = torch.cat([ours(d) for d in docs], dim=1)
    assert relative_error(packed, alone) <= 1e-5


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_prefill_then_recurrent_decode_equals_the_full_forward(kind):
    ours = ours_for(hf_model(kind, seed=4))
    tokens = torch.randint(0, TEXT["vocab_size"], (2, 72), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = ours(tokens)
        cache = new_cache(ours.cfg, 2, 72, torch.float32, "cpu")
        # two chunked prefills (the second continues from the cached states), then one token at a time
        steps = [ours(tokens[:, :41], kv_cache=cache), ours(tokens[:, 41:66], kv_cache=cache)]
        steps += [ours(tokens[:, t:t + 1], kv_cache=cache) for t in range(66, 72)]
    assert cache.conv.shape[0] == 4 and cache.k.shape[0] == 1  # GDN layers keep states, attention layers K/V
    assert relative_error(torch.cat(steps, dim=1), full) <= 1e-5


def hf_greedy(hf, prompt, max_new_tokens):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_left_padded_batch_and_continuous_batching_equal_transformers_generate(kind):
    hf = hf_model(kind, seed=6)
    ours = ours_for(hf)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, TEXT["vocab_size"], (n,), generator=gen).tolist() for n in (9, 3, 14, 6)]
    budgets = (6, 9, 4, 7)
    expected = [hf_greedy(hf, p, n) for p, n in zip(prompts, budgets)]
    # one left-padded batch: padding must leave the GDN states as if each row began at its first token
    batch = generate_ids(ours, prompts, max(budgets), Sampling(), [], 0, torch.float32)
    assert [row[:n] for row, n in zip(batch, budgets)] == expected
    # 2 rows for 4 requests: later ones join mid-way into freed (cleared) rows, rows move to stay contiguous
    batcher = Batcher(ours, None, (), max_batch=2, max_len=32, max_queue=4, dtype=torch.float32)
    done = threading.Semaphore(0)
    requests = [Request(p, n, on_event=lambda t: t is None and done.release()) for p, n in zip(prompts, budgets)]
    thread = threading.Thread(target=batcher.run)
    thread.start()
    batcher.submit(requests)
    for _ in requests:
        assert done.acquire(timeout=60)
    batcher.stop()
    thread.join(timeout=10)
    assert [r.out_ids for r in requests] == expected


def save_release(path, seed=8):
    """A Qwen3.5-MoE release directory: transformers' ConditionalGeneration (text + vision tower) in two shards,
    plus MTP tensors in a shard of their own as released checkpoints carry them, and the demo tokenizer."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = {**TEXT, **EXPERTS, "vocab_size": 8192}
    config = Qwen3_5MoeConfig(text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=24,
                                                                   num_heads=2, out_hidden_size=44))
    torch.manual_seed(seed)
    model = perturb(Qwen3_5MoeForConditionalGeneration(config), seed)
    model.save_pretrained(path, max_shard_size="300KB")
    mtp = {"mtp.fc.weight": torch.randn(44, 88), "mtp.norm.weight": torch.randn(44).to(torch.bfloat16)}
    save_file(mtp, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "mtp.safetensors" for name in mtp})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for file in DEMO_TOKENIZER.iterdir():
        shutil.copy2(file, path / file.name)
    return model


def tensors_of(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        out.update(load_file(str(path / file)))
    return out


def test_release_directory_round_trips_through_dcp_and_training_bit_exact(tmp_path, launch_here):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    src = tmp_path / "release"
    original = save_release(src)
    launch_here(tmp_path / "to_dcp", "task=convert", f"checkpoint.load_hf={src}", "convert.to=dcp",
                f"convert.out={tmp_path}/dcp")
    # a training step from the converted checkpoint (lr 1e-30: below float32 rounding of every text weight); then neither the
    # release nor the converted checkpoint is left, so what the export keeps came through the training checkpoint
    launch_here(tmp_path / "train", "task=pretrain", f"checkpoint.load={tmp_path}/dcp", "optim.lr=1e-30", "optim.min_lr=0",
                "train.steps=1", "train.seq_len=16", "train.micro_batch_size=1", "train.global_batch_size=1",
                "train.eval_every=0", "checkpoint.every=1", f"checkpoint.dir={tmp_path}/trained")
    before = tensors_of(src)
    shutil.rmtree(src)
    shutil.rmtree(tmp_path / "dcp")
    launch_here(tmp_path / "to_hf", "task=convert", f"checkpoint.load={tmp_path}/trained", "convert.to=hf",
                f"convert.out={tmp_path}/export", "convert.max_shard_size=200KB")
    after = tensors_of(tmp_path / "export")
    assert before.keys() == after.keys() and any(n.startswith("model.visual.") for n in after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == \
        ["Qwen3_5MoeForConditionalGeneration"]
    tokens = torch.randint(0, 8192, (1, 21), generator=torch.Generator().manual_seed(9))
    reloaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    text_only = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()  # the text model alone
    with torch.no_grad():
        want = original(tokens).logits
        assert torch.equal(reloaded(tokens).logits, want)
        assert relative_error(ours_for(text_only)(tokens), want) <= 1e-5


@pytest.mark.parametrize("kind,parallel", [("qwen3_next", "single"), ("qwen3_5_moe", "tp2")])
def test_generate_task_on_a_hybrid_directory_matches_transformers(kind, parallel, tmp_path, launch):
    """tp2 (no sequence parallel): each rank reads its heads' rows of in_proj_qkv and conv1d from the HF files."""
    from speedllm.data.tokenizer import load_tokenizer

    heads = dict(num_attention_heads=4, num_key_value_heads=2) if parallel == "tp2" else {}
    hf = hf_model(kind, seed=10, vocab_size=8192, **heads)
    hf.save_pretrained(tmp_path / "next")
    for file in DEMO_TOKENIZER.iterdir():
        shutil.copy2(file, tmp_path / "next" / file.name)
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    prompts = ["ROMEO:", "KING HENRY:\nWhat say you"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    code, _, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", "model=hf", f"parallel={parallel}",
                          f"checkpoint.load_hf={tmp_path / 'next'}", f"generate.prompts_file={tmp_path}/prompts.jsonl",
                          "generate.max_new_tokens=8", "generate.batch_size=2", f"generate.output={tmp_path}/out.jsonl",
                          cwd=tmp_path)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    stops = set(tok.convert_tokens_to_ids([t for t in ("<|im_end|>", "<|endoftext|>") if t in tok.get_vocab()]))
    for row, prompt in zip(rows, prompts):
        want = hf_greedy(hf, tok.encode(prompt, add_special_tokens=False), 8)
        cut = next((i + 1 for i, t in enumerate(want) if t in stops), len(want))
        assert row["completion_ids"] == want[:cut]


@pytest.mark.parametrize("model", ["qwen3_5_tiny", "qwen3_5_moe_tiny"])
def test_pretrain_on_the_tiny_hybrid_groups_then_export(model, tmp_path, launch_here):
    """A from-scratch run trains, its frozen config is the group, and its export is what transformers loads with
    the trained model's logits (the config.json written from ours)."""
    from transformers import AutoModelForCausalLM

    from speedllm.checkpoint.dcp import dcp_load

    launch_here(tmp_path / "run", f"model={model}", "task=pretrain", "train.steps=3", "train.global_batch_size=2",
                "train.micro_batch_size=2", "train.seq_len=64", "train.log_every=1", "generate.num_samples=0")
    frozen = OmegaConf.to_container(OmegaConf.load(tmp_path / "run" / "config.yaml").model)
    assert frozen == OmegaConf.to_container(compose_config(f"model={model}").model, resolve=True)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)

    launch_here(tmp_path / "convert", "task=convert", f"checkpoint.load={tmp_path}/run/checkpoints", "convert.to=hf",
                f"convert.out={tmp_path}/export")
    ours = Qwen3(OmegaConf.create(frozen)).eval()
    state = {"model": ours.state_dict()}
    dcp_load(state, next((tmp_path / "run" / "checkpoints").glob("step_*")))
    ours.load_state_dict(state["model"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokens = torch.randint(0, 8192, (1, 70), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        assert relative_error(ours(tokens), hf(tokens).logits) <= 1e-5
