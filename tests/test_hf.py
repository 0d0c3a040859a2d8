"""HF checkpoints in and out, held against transformers' own Qwen3 / Qwen3-MoE (tiny sizes, fp32 unless said).

Loading: a directory transformers saved in several shards gives our model transformers' logits.
Export: transformers' from_pretrained on our export gives our logits; HF -> ours -> HF is bit-exact and keeps
config.json; task=convert both ways through the launcher. Error cases assert their one-line message.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from speedllm.checkpoint.hf import export_model, hf_model_fields, load_hf_weights, parse_size
from speedllm.config import compose_config
from speedllm.errors import UserError
from speedllm.models.config import ModelConfig
from speedllm.models.qwen3 import Qwen3
from speedllm.paths import ASSETS

pytestmark = pytest.mark.numerics

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
KINDS = {
    "dense_tied": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "dense_untied": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "moe": dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def hf_model(kind: str, seed: int = 0, **overrides):
    """A transformers Qwen3ForCausalLM / Qwen3MoeForCausalLM with every weight perturbed (norms included)."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    kwargs = {**BASE, **KINDS[kind], **overrides}
    config = (Qwen3MoeConfig if "num_experts" in kwargs else Qwen3Config)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def save_hf(kind: str, path: Path, max_shard_size="40KB", dtype=torch.float32, tokenizer=True, **overrides) -> Path:
    """transformers' save_pretrained of a tiny model (several shards), with the demo tokenizer's files."""
    model = hf_model(kind, **overrides).to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        for file in DEMO_TOKENIZER.iterdir():
            shutil.copy2(file, path / file.name)
    return path


def our_model(path: Path) -> Qwen3:
    """Our Qwen3 for an HF directory: config from its config.json, weights loaded by load_hf_weights."""
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": path.name, **hf_model_fields(str(path))})
    with torch.device("meta"):
        model = Qwen3(cfg)
    model.to_empty(device="cpu")
    model.tie_embeddings()
    load_hf_weights(model, str(path))
    return model.eval()


def tensors(path: Path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def assert_bit_exact(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {kind: save_hf(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


TOKENS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_hf_dir_loads_to_transformers_logits(kind, hf_dirs):
    from transformers import AutoModelForCausalLM

    path = hf_dirs[kind]
    assert len(list(path.glob("*.safetensors"))) > 3  # really several shards, through the index
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (our_model(path)(TOKENS) - reference(TOKENS).logits).abs().max().item()
    assert diff <= 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_in_transformers_with_our_logits(kind, tmp_path):
    """Our own initialization, exported without any HF source: config.json is generated from our config."""
    from transformers import AutoModelForCausalLM

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": kind, **BASE, "rope_theta": 10000.0,
                                                               **{k: v for k, v in KINDS[kind].items()
                                                                  if k != "rope_parameters"}})
    ours = Qwen3(cfg)
    ours.init_weights(seed=3)
    export_model(ours, str(tmp_path / "out"), max_shard_size="30KB", tokenizer=str(DEMO_TOKENIZER), progress=False)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    assert ("lm_head.weight" in index["weight_map"]) == (not cfg.tie_word_embeddings)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (loaded(TOKENS).logits - ours.eval()(TOKENS)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("kind,dtype", [("dense_tied", torch.float32), ("moe", torch.bfloat16)])
def test_hf_to_ours_to_hf_is_bit_exact(kind, dtype, tmp_path):
    """In memory: HF -> our fp32 model -> HF in the source dtype reproduces every tensor and config.json."""
    source = save_hf(kind, tmp_path / "src", dtype=dtype)
    export_model(our_model(source), str(tmp_path / "out"), max_shard_size="50KB", dtype=dtype, source=str(source),
                 progress=False)
    assert_bit_exact(source, tmp_path / "out")


CPU = ["hardware=cpu", "hardware.dtype=float32", "logging.progress_bar=false"]


def test_convert_hf_to_dcp_to_hf_through_the_launcher(tmp_path, launch):
    source = save_hf("moe", tmp_path / "src", dtype=torch.bfloat16)
    code, out, err = launch(tmp_path / "run1", *CPU, "task=convert", f"checkpoint.load_hf={source}", "convert.to=dcp",
                            f"convert.out={tmp_path / 'dcp'}")
    assert code == 0, err
    assert (tmp_path / "dcp" / "latest").read_text().strip() == "step_00000000"
    saved = OmegaConf.load(tmp_path / "dcp" / "step_00000000" / "config.yaml")
    assert saved.model.num_experts == 4 and saved.model.hidden_size == 64
    code, out, err = launch(tmp_path / "run2", *CPU, "task=convert", f"checkpoint.load={tmp_path / 'dcp'}",
                            "convert.to=hf", "convert.max_shard_size=60KB", f"convert.out={tmp_path / 'hf'}")
    assert code == 0, err
    assert "safetensors shard(s)" in out
    assert_bit_exact(source, tmp_path / "hf")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


def test_model_hf_takes_config_json_in_either_spelling(hf_dirs, tmp_path):
    """transformers 5 writes rope_parameters / num_local_experts, transformers 4 rope_theta / num_experts."""
    path = hf_dirs["moe"]
    cfg = compose_config("model=hf", f"checkpoint.load_hf={path}")
    assert (cfg.model.num_experts, cfg.model.moe_intermediate_size, cfg.model.rope_theta, cfg.model.tokenizer) == (
        4, 32, 10000.0, str(path))
    old = tmp_path / "old"
    shutil.copytree(path, old)
    config = json.loads((old / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["num_experts"] = config.pop("num_local_experts")
    (old / "config.json").write_text(json.dumps(config))
    assert hf_model_fields(str(old)) == hf_model_fields(str(path))
    with torch.no_grad():
        assert torch.equal(our_model(old)(TOKENS), our_model(path)(TOKENS))


def broken(path: Path, tmp_path: Path, edit) -> str:
    """Copy an HF dir, let `edit(dir)` break it, and return load_hf_weights' error message."""
    target = tmp_path / "broken"
    shutil.copytree(path, target)
    edit(target)
    with pytest.raises(UserError) as err:
        our_model(target)
    assert "\n" not in str(err.value)
    return str(err.value)


def _rewrite(path: Path, name: str, change) -> None:
    """Rewrite the shard holding `name` with `change(tensors)` applied (the index follows)."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    file = path / index["weight_map"][name]
    with safe_open(str(file), framework="pt") as f:
        shard = {k: f.get_tensor(k) for k in f.keys()}
    change(shard)
    save_file(shard, str(file), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in shard or v != file.name}
    index["weight_map"].update({k: file.name for k in shard})
    index_file.write_text(json.dumps(index))


def test_missing_tensor_is_named(hf_dirs, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    message = broken(hf_dirs["moe"], tmp_path, lambda p: _rewrite(p, name, lambda s: s.pop(name)))
    assert message == (f"checkpoint.load_hf={tmp_path / 'broken'}: 1 tensor(s) missing: {name}; the directory does "
                       "not hold every weight its config.json describes")


def test_unexpected_tensor_is_named(hf_dirs, tmp_path):
    extra = "model.layers.0.self_attn.q_proj.bias"
    message = broken(hf_dirs["dense_untied"], tmp_path, lambda p: _rewrite(
        p, "model.layers.0.self_attn.q_proj.weight", lambda s: s.update({extra: torch.zeros(64)})))
    assert message == (f"checkpoint.load_hf={tmp_path / 'broken'}: unexpected tensor(s) {extra} are not part of the "
                       "model its config.json describes; fix config.json or remove them")


def test_wrong_shape_names_tensor_expected_and_actual(hf_dirs, tmp_path):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config["intermediate_size"] = 80
        (path / "config.json").write_text(json.dumps(config))

    message = broken(hf_dirs["dense_tied"], tmp_path, edit)
    assert message.startswith(f"checkpoint.load_hf={tmp_path / 'broken'}: tensor model.layers.0.mlp.")
    assert "has shape [96, 64] but config.json implies [80, 64]" in message or \
        "has shape [64, 96] but config.json implies [64, 80]" in message


def test_unsupported_architecture_lists_the_supported_ones(hf_dirs, tmp_path):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = ["LlamaForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))

    assert broken(hf_dirs["dense_tied"], tmp_path, edit) == (
        f"checkpoint.load_hf={tmp_path / 'broken'}: config.json architectures ['LlamaForCausalLM'] is not "
        "supported; supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, "
        "Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration")


def test_incomplete_directory_names_what_is_missing(hf_dirs, tmp_path):
    index = json.loads((hf_dirs["dense_tied"] / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    assert broken(hf_dirs["dense_tied"], tmp_path, lambda p: (p / shard).unlink()) == (
        f"checkpoint.load_hf={tmp_path / 'broken'}: model.safetensors.index.json names shard(s) that are not there: "
        f"{shard}; copy the whole directory")
    shutil.rmtree(tmp_path / "broken")
    assert broken(hf_dirs["dense_tied"], tmp_path, lambda p: (p / "config.json").unlink()) == (
        f"checkpoint.load_hf={tmp_path / 'broken'}: no config.json there; point it at a Hugging Face model directory "
        "(config.json + *.safetensors)")


def test_parse_size():
    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "40KB", "123")] == [5 * 10**9, 5 * 10**8, 2 * 2**30,
                                                                             40_000, 123]
    with pytest.raises(UserError, match="convert.max_shard_size=big is not a size"):
        parse_size("big")


@pytest.fixture(scope="module")
def launcher_hf_dir(tmp_path_factory):
    """A tiny Qwen3 whose vocabulary covers the demo tokenizer (as the launcher's tokenizer check demands)."""
    return save_hf("dense_untied", tmp_path_factory.mktemp("hf8192"), vocab_size=8192, max_shard_size="200KB")


def test_validation_rejects_model_disagreeing_with_config_json(launcher_hf_dir, tmp_path, launch):
    code, out, err = launch(tmp_path, *CPU, "task=pretrain", f"checkpoint.load_hf={launcher_hf_dir}",
                            "model=qwen3_tiny")
    assert code == 2, err
    assert err.strip() == (
        f"error: checkpoint.load_hf={launcher_hf_dir}: config.json disagrees with model=qwen3_tiny on hidden_size (64 "
        "vs 256), intermediate_size (96 vs 768), num_hidden_layers (2 vs 4), head_dim (16 vs 64), rope_theta "
        "(500000.0 vs 10000.0), tie_word_embeddings (False vs True) (config.json vs model); use model=hf to take the "
        "model from config.json, or the matching model=")
    assert "Traceback" not in out + err


def test_model_hf_without_load_hf_is_rejected():
    from speedllm.config.validate import validate

    with pytest.raises(UserError) as err:
        validate(compose_config("model=hf", "hardware=cpu", "hardware.dtype=float32"), 1, 1)
    assert str(err.value) == ("model=hf takes the model from checkpoint.load_hf's config.json; set "
                              "checkpoint.load_hf=<HF model dir>")


def test_demo_style_export_stops_at_its_end_token_in_transformers_generate(tmp_path):
    """A checkpoint of the demo model (qwen3_tiny, demo tokenizer) exported by task=convert: config.json carries
    the tokenizer's eos/bos/pad ids and generation_config.json the stop ids, so transformers' generate with no
    arguments stops at the end token; files have the mode the umask asks for.

    Weights are set so the next token depends on the current one only (attention and MLP outputs zero): prompt ->
    a -> b -> <|endoftext|> -> (were generation not stopped) token 0 up to transformers' default max_length 20.
    """
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speedllm.checkpoint.dcp import save_checkpoint
    from speedllm.tasks.convert import dcp_to_hf

    cfg = compose_config("model=qwen3_tiny", "model.hidden_size=32", "model.intermediate_size=64",
                   "model.num_hidden_layers=1", "model.head_dim=8", "model.tie_word_embeddings=false",
                   f"run_dir={tmp_path}", "logging.progress_bar=false")
    OmegaConf.resolve(cfg)
    eod = AutoTokenizer.from_pretrained(DEMO_TOKENIZER).convert_tokens_to_ids("<|endoftext|>")
    prompt, a, b = 100, 200, 300
    model = Qwen3(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.norm, model.layers["0"].input_layernorm, model.layers["0"].post_attention_layernorm):
            norm.weight.fill_(1.0)
        for dim, (token, successor) in enumerate([(prompt, a), (a, b), (b, eod)]):
            model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[successor, dim] = 1.0
    save_checkpoint(str(tmp_path / "ckpt"), 1, model, torch.optim.AdamW(model.parameters()), {}, cfg, keep=0)
    old_mask = os.umask(0o022)
    try:
        out = dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), cfg)
    finally:
        os.umask(old_mask)

    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] is not None and config["pad_token_id"] is not None
    assert eod in json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}
    hf = AutoModelForCausalLM.from_pretrained(out)
    generated = hf.generate(torch.tensor([[prompt]]))
    assert generated.tolist() == [[prompt, a, b, eod]]


def test_fsdp2_shards_of_fewer_experts_than_ranks_read_from_a_qwen3_next_dir(tmp_path):
    """Qwen3-Next with 5 experts under FSDP2 over 4 ranks: torch.chunk gives the ranks 2, 2, 1 and no experts.
    Each rank reads its experts' rows of the file, and the last one an empty block (its load failed with "stack
    expects a non-empty TensorList")."""
    import transformers

    from speedllm.checkpoint.hf import hf_reader, weight_files

    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, intermediate_size=32, num_experts=5, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(tmp_path)
    model = compose_config("model=hf", f"checkpoint.load_hf={tmp_path}").model
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stacked = torch.stack([f.get_tensor(f"model.layers.1.mlp.experts.{e}.up_proj.weight") for e in range(5)])
    shards = [ids.tolist() for ids in torch.arange(5).chunk(4)]
    shards += [[]] * (4 - len(shards))
    assert [len(s) for s in shards] == [2, 2, 1, 0]
    with hf_reader(str(tmp_path), model, weight_files(str(tmp_path))) as read:
        for ids in shards:
            first = ids[0] if ids else 5
            index = (slice(first, first + len(ids)), slice(0, 16), slice(0, 32))
            assert torch.equal(read("layers.1.mlp.experts.up_proj", (5, 16, 32), index), stacked[index])
