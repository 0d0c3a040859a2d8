"""task=distill's teacher: what `distill.teacher` names (a Hugging Face directory or one of our checkpoints, with the
model config it was trained with), checked against the student before launch, then built frozen under the job's
layout (FSDP2 / tensor parallel like the student) and loaded."""

from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from speedllm.errors import UserError, reading

KEY = "distill.teacher"


class TeacherSource(NamedTuple):
    model: DictConfig  # the teacher's ModelConfig
    tokenizer: Optional[str]  # its tokenizer directory, where it names one
    hf: bool  # a Hugging Face directory (else a checkpoint step directory)
    path: str  # the directory to load: the HF directory or the resolved step directory


def _renamed(error: UserError, key: str) -> UserError:
    """An error of the HF / checkpoint readers, which name checkpoint.load_hf / checkpoint.load, naming KEY."""
    return UserError(str(error).replace(f"{key}=", f"{KEY}=", 1))


def teacher_source(path: str) -> TeacherSource:
    """The teacher's model config and tokenizer from distill.teacher; UserError (one line) when it is not a model."""
    from speedllm.checkpoint.dcp import read_saved_config, resolve_load
    from speedllm.checkpoint.hf import has_tokenizer, hf_model_fields
    from speedllm.models.config import ModelConfig

    root = Path(path)
    if not root.is_dir():
        raise UserError(f"{KEY}={path} does not exist; point it at a Hugging Face model directory or a checkpoint "
                        "directory of a training run")
    if (root / "config.json").is_file():
        try:
            fields = hf_model_fields(path)
        except UserError as e:
            raise _renamed(e, "checkpoint.load_hf") from None
        model = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": root.name, **fields})
        return TeacherSource(model, path if has_tokenizer(path) else None, True, path)
    if not (root / ".metadata").is_file() and not (root / "latest").is_file():
        raise UserError(f"{KEY}={path} is not a model: no config.json (Hugging Face) and no checkpoint (.metadata or "
                        "'latest'); point it at a Hugging Face model directory or a checkpoint directory")
    try:
        step_dir = resolve_load(path, "")
        saved = read_saved_config(step_dir)
    except UserError as e:
        raise _renamed(e, "checkpoint.load") from None
    if OmegaConf.select(saved, "finetune.name", default="full") != "full":
        raise UserError(f"{KEY}={path} holds LoRA adapters only; export the merged model first (task=convert "
                        f"convert.to=hf convert.merge_lora=true) and point {KEY} at it")
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.model)
    return TeacherSource(model, str(saved.data.tokenizer), False, str(step_dir))


def _vocabulary(tokenizer_dir: str, key: str) -> Optional[dict]:
    """token -> id of a tokenizer directory's tokenizer.json (added tokens included), None without one."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    with reading(f"{key}: {file}", "restore the tokenizer's files, or point the key at a complete model"):
        return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)


def check_teacher(cfg: DictConfig) -> TeacherSource:
    """The teacher exists, is a model, and shares the student's vocabulary and tokenizer (one line each)."""
    if cfg.distill.teacher is None:
        raise UserError(f"task=distill needs {KEY}=<Hugging Face model dir or checkpoint dir of a training run>")
    source = teacher_source(str(cfg.distill.teacher))
    student = cfg.model
    if source.model.vocab_size != student.vocab_size:
        raise UserError(f"{KEY}={cfg.distill.teacher} has vocab_size={source.model.vocab_size} but the student "
                        f"(model={student.name}) has vocab_size={student.vocab_size}; distill between models of one "
                        "vocabulary (the same tokenizer)")
    if source.tokenizer is not None:
        ours = _vocabulary(str(cfg.data.tokenizer), "data.tokenizer")
        theirs = _vocabulary(source.tokenizer, KEY)
        if ours is not None and theirs is not None and ours != theirs:
            raise UserError(f"{KEY}={cfg.distill.teacher}: its tokenizer ({source.tokenizer}) differs from the "
                            f"student's data.tokenizer={cfg.data.tokenizer}; distill between models of one tokenizer")
    return source


def teacher_run_config(cfg, source: TeacherSource):
    """The run config (the typed run a task is given) the teacher is built with: the job's layout and dtype, the
    teacher's model, plain full weights (no adapters, no quantization-aware training, no recompute: it never runs
    backward)."""
    from dataclasses import replace

    load_hf, load = (source.path, None) if source.hf else (None, source.path)
    return replace(cfg, model=OmegaConf.to_object(source.model), finetune=type(cfg.finetune)(),
                   quant=type(cfg.quant)(),
                   train=replace(cfg.train, recompute="none", compile=False, activation_offload=False),
                   parallel=replace(cfg.parallel, offload="none"),
                   checkpoint=replace(cfg.checkpoint, load_hf=load_hf, load=load))


def whole_teacher(cfg) -> bool:
    """Whether every rank holds the whole teacher as plain modules: distill.teacher_parallel=replicate, or an int8
    teacher (which the layout rules allow only where the student's layout would not shard it)."""
    return cfg.distill.teacher_parallel == "replicate" or cfg.distill.teacher_quant != "none"


def build_teacher(cfg: DictConfig, rt) -> nn.Module:
    """The frozen teacher on this rank, its weights loaded, in eval mode: built under the job's layout, or whole
    (load_whole_teacher)."""
    from speedllm.generation.load import load_weights
    from speedllm.train.build import build_model

    tcfg = teacher_run_config(cfg, teacher_source(str(cfg.distill.teacher)))
    if whole_teacher(cfg):
        teacher = load_whole_teacher(tcfg, cfg.distill.teacher_quant, rt.device)
    else:
        teacher = build_model(tcfg, rt).module
        load_weights(teacher, tcfg)
    return teacher.requires_grad_(False).eval()


def load_whole_teacher(tcfg, scheme: str, device: torch.device) -> nn.Module:
    """A whole teacher (plain modules: no layout applies, nothing is gathered) read piece by piece from its
    weights; with scheme (distill.teacher_quant) each decoder layer's projections are quantized as soon as the
    layer is read, so the full-precision teacher never exists whole (as speedllm.generation.load.load_quantized does
    for inference; here the embedding and output projection stay full precision: the student's loss reads the
    output weight)."""
    from speedllm.generation.load import WeightSource, fill_layers
    from speedllm.models.moe import take_expert_load
    from speedllm.models.qwen3 import Qwen3

    with torch.device("meta"):
        teacher = Qwen3(tcfg.model, ops=tcfg.hardware.ops)
    source = WeightSource(tcfg, teacher.cfg)
    parts = {"embed_tokens": teacher.embed_tokens, "norm": teacher.norm}
    if not teacher.cfg.tie_word_embeddings:
        parts["lm_head"] = teacher.lm_head
    for prefix, part in parts.items():
        part.to_empty(device=device)
        source.fill(part, prefix + ".")
    teacher.tie_embeddings()
    fill_layers(teacher, source, device, lambda layer: quantize_teacher(layer, scheme))
    take_expert_load(teacher)  # MoE load tallies from zero (to_empty left them unset)
    return teacher


def quantize_teacher(module: nn.Module, scheme: str, device=None) -> None:
    """distill.teacher_quant: the decoder projections of `module` (the teacher, or one of its layers) in `scheme`
    (speedllm.quant.quantize_linears: on CPUs our int8 layers, on GPUs torchao's); embeddings, output projection,
    norms and MoE experts stay in full precision. device: whose layers (default: the module's)."""
    from types import SimpleNamespace

    from speedllm.quant import quantize_linears

    if scheme != "none":  # quantize_linears reads the quant section's name (int8: no group size)
        quantize_linears(module, SimpleNamespace(name=scheme), device=device)


@contextmanager
def head_weight(teacher: nn.Module):
    """The teacher's output weight, whole over the data-parallel ranks while in use: FSDP2 gathers the root's
    parameters (embeddings, final norm, output projection) and frees them after; under tensor parallelism it stays
    this rank's vocabulary rows (a DTensor)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(teacher, FSDPModule)
    if sharded:
        teacher.unshard()
    try:
        yield teacher.lm_head.weight
    finally:
        if sharded:
            teacher.reshard()


def teacher_hidden(teacher: nn.Module, batch: dict) -> torch.Tensor:
    """The teacher's final hidden states [B * S, Dt] of a loader batch (no gradient)."""
    from speedllm.train.distill_loss import final_hidden
    from speedllm.train.step import model_inputs

    with torch.no_grad():
        hidden, _ = teacher(batch["tokens"], **model_inputs(batch), output_loss=final_hidden)
    return hidden
