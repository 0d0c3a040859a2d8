"""task=generate: token-identical to transformers' `generate`, sampling as transformers defines it, reproducible
seeds, stop tokens/strings, and the launcher path (HF dir, DCP checkpoint, jsonl in/out, TP2 = single process)."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from speedllm.config.schema import GenerateConfig
from speedllm.data.tokenizer import load_tokenizer
from speedllm.generation.engine import Detokenizer, StopStrings, generate_ids
from speedllm.generation.sampling import Sampling, process_logits
from speedllm.models import Qwen3
from speedllm.models.hf_adapter import from_hf_state_dict
from speedllm.paths import ASSETS

pytestmark = pytest.mark.numerics

VOCAB = 96
DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def stop_ids(tok):
    """Qwen's end of turn and end of text (the demo tokenizer's eos and pad)."""
    return [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]


def hf_greedy(hf, prompts, max_new_tokens, eos=()):
    """transformers' greedy generate over left-padded prompts (pad 0); rows cut after their first eos id."""
    S = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), S, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for b, p in enumerate(prompts):
        tokens[b, S - len(p):], mask[b, S - len(p):] = torch.tensor(p), 1
    out = hf.generate(tokens, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                      eos_token_id=list(eos) or None)[:, S:].tolist()
    ends = [[i + 1 for i, t in enumerate(row) if t in eos] + [len(row)] for row in out]
    return [row[: end[0]] for row, end in zip(out, ends)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_is_token_identical_to_transformers(moe, hf_pair):
    _, hf, ours = hf_pair(seed=3, **(MOE if moe else {}))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (6, 11, 1, 8)]
    # batch 1
    expected = hf_greedy(hf, prompts[:1], 24)
    assert len(expected[0]) == 24
    assert generate_ids(ours, prompts[:1], 24, Sampling(), [], 0, torch.float32) == expected
    # batch 4, different prompt lengths (left padding)
    expected = hf_greedy(hf, prompts, 24)
    assert generate_ids(ours, prompts, 24, Sampling(), [], 0, torch.float32) == expected


def test_rows_stop_at_their_own_eos_like_transformers(hf_pair):
    _, hf, ours = hf_pair(seed=5)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (4, 7, 5)]
    free = generate_ids(ours, prompts, 16, Sampling(), [], 0, torch.float32)
    eos = free[1][3]  # a token row 1 emits at step 4: it must stop there, the others go on unless they emit it
    expected = hf_greedy(hf, prompts, 16, eos=[eos])
    got = generate_ids(ours, prompts, 16, Sampling(), [eos], 0, torch.float32)
    assert got == expected
    assert len(got[1]) <= 4 and got[1][-1] == eos


def test_logit_processing_matches_transformers():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    history = torch.randint(0, 50, (3, 7), generator=gen)
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, history, True)
    for s in [Sampling(0.7, 5, 1.0, 1.0), Sampling(1.3, 0, 0.8, 1.0), Sampling(0.9, 10, 0.6, 1.3),
              Sampling(0.0, 0, 1.0, 1.5)]:
        processors = LogitsProcessorList()
        if s.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        if not s.greedy:
            processors.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k:
                processors.append(TopKLogitsWarper(s.top_k))
            if s.top_p < 1.0:
                processors.append(TopPLogitsWarper(s.top_p))
        expected = processors(history, logits.clone())
        assert torch.allclose(process_logits(logits, s, seen), expected, atol=1e-6, equal_nan=True), s


def test_sampling_is_reproducible_with_a_seed(hf_pair):
    _, _, ours = hf_pair(seed=7)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    s = Sampling(temperature=1.0, top_k=20, top_p=0.95, repetition_penalty=1.1)
    a = generate_ids(ours, prompts, 20, s, [], 0, torch.float32, seed=11)
    b = generate_ids(ours, prompts, 20, s, [], 0, torch.float32, seed=11)
    c = generate_ids(ours, prompts, 20, s, [], 0, torch.float32, seed=12)
    assert a == b
    assert a != c
    greedy = generate_ids(ours, prompts, 20, Sampling(), [], 0, torch.float32)
    assert generate_ids(ours, prompts, 20, Sampling(temperature=1.0, top_k=1), [], 0, torch.float32, seed=3) == greedy


def test_stop_strings_and_streaming(hf_pair):
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    _, _, ours = hf_pair(seed=8, vocab_size=len(tok))
    prompt = tok.encode("ROMEO:", add_special_tokens=False)
    streamed = []
    detok = Detokenizer(tok, [], [])
    full = generate_ids(ours, [prompt], 12, Sampling(), [], 0, torch.float32,
                        on_token=lambda token: streamed.append(detok.add(token)))
    text = tok.decode(full[0], skip_special_tokens=True)
    assert "".join(streamed) == text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    stops = StopStrings(tok, [stop])
    cut = generate_ids(ours, [prompt], 12, Sampling(), [], 0, torch.float32, stop_strings=stops)[0]
    assert full[0][: len(cut)] == cut and len(cut) < len(full[0])
    assert stop in tok.decode(cut) and stop not in tok.decode(cut[:-1])
    assert stops.cut(text) == text[: text.find(stop)]


def test_sample_texts_for_the_training_loop(hf_pair):
    """The end-of-training samples: greedy completions as text, the model handed back in training mode."""
    from speedllm.generation.complete import sample_texts

    tok = load_tokenizer(str(DEMO_TOKENIZER))
    _, hf, ours = hf_pair(seed=10, vocab_size=len(tok))
    ours.train()
    cfg = OmegaConf.create({"generate": OmegaConf.structured(GenerateConfig(max_new_tokens=6)),
                            "hardware": {"dtype": "float32"}, "parallel": {"tp": 1}})
    prompts = ["ROMEO:\n", "First Citizen:\n"]
    texts = sample_texts(ours, tok, prompts, cfg)
    for prompt, text in zip(prompts, texts):
        (ids,) = hf_greedy(hf, [tok.encode(prompt, add_special_tokens=False)], 6, eos=stop_ids(tok))
        assert text == tok.decode([t for t in ids if t not in stop_ids(tok)], skip_special_tokens=True)
    assert ours.training


# ------------------------------------------------------------------------------------- through launch.py

PROMPTS = ["ROMEO:", "KING HENRY:\nWhat say you", "First"]


def expected_rows(hf, tok, max_new_tokens):
    rows = []
    for p in PROMPTS:  # one at a time: no padding at all in the reference
        ids = hf_greedy(hf, [tok.encode(p, add_special_tokens=False)], max_new_tokens, eos=stop_ids(tok))[0]
        rows.append({"prompt": p, "completion_ids": ids})
    return rows


def read_rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_generate_task_from_hf_dir_matches_transformers_then_tp2_matches_single(hf_dir, tmp_path, launch):
    path, hf, tok = hf_dir
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in PROMPTS[:2]) +
                                            "\n" + json.dumps({"prompt": PROMPTS[2]}) + "\n")
    common = ["task=generate", "model=hf", f"checkpoint.load_hf={path}",
              f"generate.prompts_file={tmp_path}/prompts.jsonl", "generate.max_new_tokens=10", "generate.batch_size=2"]
    code, out, err = launch(tmp_path / "run", "hardware=cpu", *common, f"generate.output={tmp_path}/single.jsonl",
                            cwd=tmp_path)
    assert code == 0, err
    rows = read_rows(tmp_path / "single.jsonl")
    expected = expected_rows(hf, tok, 10)
    assert [{k: r[k] for k in ("prompt", "completion_ids")} for r in rows] == expected
    for row in rows:
        assert row["completion"] == tok.decode(row["completion_ids"], skip_special_tokens=True)
        assert f"{row['prompt']}{row['completion']}" in out

    # the frozen config is the model that ran: the architecture of the HF directory, as transformers reads it
    frozen = OmegaConf.load(tmp_path / "run" / "config.yaml").model
    hf_config = AutoConfig.from_pretrained(path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert frozen[key] == getattr(hf_config, key), key
    assert frozen.rope_theta == hf_config.rope_parameters["rope_theta"]

    code, out, err = launch(tmp_path / "run", "hardware=cpu", *common, "parallel=tp2",
                            f"generate.output={tmp_path}/tp2.jsonl", cwd=tmp_path)
    assert code == 0, err
    assert read_rows(tmp_path / "tp2.jsonl") == rows


def test_generate_task_from_dcp_checkpoint_streams_one_prompt(hf_dir, tmp_path, tiny_model_cfg, launch):
    """A training checkpoint (saved by the training code) generates what transformers does on its weights."""
    from speedllm.checkpoint.dcp import save_checkpoint

    path, hf, tok = hf_dir
    model_cfg = tiny_model_cfg(vocab_size=len(tok), tie_word_embeddings=True, tokenizer=str(DEMO_TOKENIZER))
    cfg = OmegaConf.create({"model": OmegaConf.to_container(model_cfg),
                            "data": {"tokenizer": str(DEMO_TOKENIZER)}})
    model = Qwen3(cfg.model)
    model.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg.model))
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(str(tmp_path / "ckpt"), 5, model, optimizer, {"step": 5}, cfg, keep=1)
    code, out, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", f"checkpoint.load={tmp_path}/ckpt",
                            f"generate.prompt={PROMPTS[0]}",
                            "generate.max_new_tokens=10", f"generate.output={tmp_path}/out.jsonl", cwd=tmp_path)
    assert code == 0, err
    (row,) = read_rows(tmp_path / "out.jsonl")
    assert [{k: row[k] for k in ("prompt", "completion_ids")}] == expected_rows(hf, tok, 10)[:1]
    assert f"{PROMPTS[0]}{row['completion']}\n" in out and "--- " not in out  # streamed, not printed at the end
    # the run's frozen config holds the checkpoint's model (adopted before freezing), not the default model=
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").model == OmegaConf.create(cfg.model)


def test_generate_user_errors(tmp_path, launch):
    code, _, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", "generate.prompt=hi", cwd=tmp_path)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: task=generate needs weights: checkpoint.load")
    code, _, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", cwd=tmp_path)  # prompt, then weights
    assert code == 2 and "error: task=generate needs generate.prompt=<text> or generate.prompts_file" in err
    (tmp_path / "ckpt").mkdir()
    code, _, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", f"checkpoint.load={tmp_path}/ckpt",
                          "generate.prompt=hi", cwd=tmp_path)
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: checkpoint.load={tmp_path}/ckpt: no DCP "
                                                                 "checkpoint there")
    code, _, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", "generate.prompt=hi",
                          "generate.top_p=0", cwd=tmp_path)
    assert code == 2 and "error: generate.top_p=0.0 must be in (0, 1] (1 = off)" in err
