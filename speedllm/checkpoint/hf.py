"""Hugging Face checkpoints in and out.

In: `load_hf_weights(model, dir)` fills a model in any parallel layout from an HF directory (config.json,
one or many *.safetensors, model.safetensors.index.json): a Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5 causal LM,
or a Qwen3.5 release (`…ForConditionalGeneration`), whose text model is what we load and train. Every tensor of this rank's state dict (a plain
tensor, or a DTensor under FSDP2 / TP / EP, a subset of layers on a pipeline stage) is read as exactly the
slice this rank holds, straight from the safetensors files: no rank reads a whole model.

Out: `write_hf_dir(...)` writes sharded safetensors (named as the source directory names them: prefix, per-expert
or fused experts; no lm_head when tied), the index, config.json, generation_config.json and the tokenizer files,
into a temp directory renamed when complete.

A release's tensors beside the text model (the vision tower `model.visual.*`, the MTP head `mtp.*`) are not part
of our model: nothing trains them, so they are not held beside every rank's parameters. They travel as files
(`write_release`): task=convert and every full-weight training checkpoint keep them, unchanged, as safetensors
in the step directory's `hf_extras/`, beside `hf/`, the release's config.json, tokenizer and tensor naming (copied
from the HF directory or checkpoint the run started from, then from the run's own previous checkpoint). An export
writes them back from there, so it is again a complete release directory with its original config.json, even
after the source directory is gone.

Names follow speedllm.models.hf_adapter (the one name map); the files are checked against the shapes the
config implies before anything is read, so a bad directory fails with the tensor named, not mid-load.

Why not torch.distributed.checkpoint's HuggingFaceStorageReader / Writer (what torchtitan uses): they map one
stored key to one state-dict key. Our MoE experts are one stacked [E, out, in] parameter made of E stored
tensors, so reading through DCP would first build every expert's full tensor under its HF name and then copy
them into the stack (a rank of an EP/FSDP layout here reads only its experts' slices), and writing would need
the unstacking done beforehand plus DCP's consolidation pass to give transformers' shard layout and index.
The tied lm_head (absent from the files) is a third special case. Reading and writing with `safetensors`
directly keeps each of these one line; tensors round-trip bit-exactly and transformers loads the export
(tests/test_hf.py).
"""

import json
import os
import re
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple, get_origin

import torch
from torch import nn

from speedllm import storage
from speedllm.adapters.lora import is_adapter, unwrapped
from speedllm.errors import UserError, reading
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import (
    ARCHITECTURES,
    RELEASES,
    HFNames,
    hf_config,
    has_qkv_rows,
    hf_names_of,
    is_extra,
    model_config_from_hf,
    qkv_channels,
    to_hf_state_dict,
)
from speedllm.outputs import MARKER, make_scratch_dir
from speedllm.quant.nf4 import fill_nf4_, is_nf4

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values()) + tuple(RELEASES.values())
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
INDEX = "model.safetensors.index.json"
# Fields that change what the weights compute; the others (initializer_range, router_aux_loss_coef,
# max_position_embeddings) are training choices a run may set differently from the checkpoint.
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "layer_types",
               "attention_output_gate", "zero_centered_norm", "partial_rotary_factor", "linear_num_key_heads",
               "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
               "linear_fused_projections")
OTHER_FIELDS = ("max_position_embeddings", "initializer_range", "router_aux_loss_coef")


# ---------------------------------------------------------------------------------------------- config

def read_hf_config(path: str) -> dict:
    """config.json of an HF model directory, after checking that it is a Qwen3-family causal LM or release."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise UserError(f"checkpoint.load_hf={path}: no config.json there; point it at a Hugging Face model "
                        "directory (config.json + *.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, OSError) as e:
        raise UserError(f"checkpoint.load_hf={path}: config.json is not valid JSON ({e}); fix or replace it") from None
    if not isinstance(config, dict):
        raise UserError(f"checkpoint.load_hf={path}: config.json holds a JSON {type(config).__name__}, not an object; "
                        "fix or replace it")
    archs = config.get("architectures") or []
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported:
        raise UserError(f"checkpoint.load_hf={path}: config.json architectures {unsupported} is not supported; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return config


def _model_defaults() -> dict:
    return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default for f in fields(ModelConfig)}


def hf_model_fields(path: str) -> dict:
    """Every architecture field of our ModelConfig, from an HF directory's config.json (dense: MoE fields 0)."""
    defaults = _model_defaults()
    fix = "fix config.json or save the model again with save_pretrained"
    with reading(f"checkpoint.load_hf={path}: config.json", fix):
        found = model_config_from_hf(read_hf_config(path))
    fields_ = {key: found.get(key, defaults[key]) for key in ARCH_FIELDS + OTHER_FIELDS}
    from speedllm.models.config import ModelConfig

    # plain fields and lists are checked here; rope_scaling (a dict or None) by speedllm.models.rope
    kinds = {f.name: f.type if f.type in (int, float, bool) else list for f in fields(ModelConfig)
             if f.type in (int, float, bool) or get_origin(f.type) is list}
    for key, value in fields_.items():
        want = kinds.get(key)
        if want is None:
            continue
        fits = isinstance(value, (int, float) if want is float else want) and (
            want is bool or not isinstance(value, bool))
        if not fits:
            raise UserError(f"checkpoint.load_hf={path}: config.json {key}={value!r} is not a {want.__name__}; {fix}")
    return fields_


def hf_model_field(path: Optional[str], key: str):
    """Resolver behind conf/model/hf.yaml: `${hf_model:${checkpoint.load_hf},hidden_size}`."""
    if path is None:
        raise UserError("model=hf takes the model from checkpoint.load_hf's config.json; set "
                        "checkpoint.load_hf=<HF model dir>")
    return hf_model_fields(path)[key]


def config_mismatches(model_cfg, path: str) -> List[str]:
    """`field (file vs model)` for each architecture field where config.json and the model config differ."""
    hf = hf_model_fields(path)
    ours = {key: getattr(model_cfg, key) for key in ARCH_FIELDS}
    ours["mlp_only_layers"], ours["layer_types"] = list(ours["mlp_only_layers"]), list(ours["layer_types"])
    return [f"{key} ({hf[key]} vs {value})" for key, value in ours.items() if hf[key] != value]


# ----------------------------------------------------------------------------------------- reading

def weight_files(path: str) -> Dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the index, else from every *.safetensors)."""
    root = Path(path)
    index = root / INDEX
    if index.is_file():
        with reading(f"checkpoint.load_hf={path}: {INDEX}", "fix it, or remove it to read every *.safetensors"):
            weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"checkpoint.load_hf={path}: {INDEX} weight_map is not a mapping of tensor names to "
                            "files; fix it, or remove it to read every *.safetensors")
        absent = {file for file in weight_map.values() if not (root / file).is_file()}
        if absent:
            raise UserError(f"checkpoint.load_hf={path}: {INDEX} names shard(s) that are not there: "
                            f"{_names(absent)}; copy the whole directory")
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint.load_hf={path}: no *.safetensors there; save the model with "
                        "save_pretrained(safe_serialization=True) (the default)")
    names = {}
    for file in files:
        with _open_safetensors(path, file) as reader:
            names.update({name: file for name in reader.keys()})
    return names


@contextmanager
def _open_safetensors(path: str, file: Path):
    """safe_open, with a damaged or foreign file refused in one line naming it."""
    from safetensors import safe_open

    with reading(f"checkpoint.load_hf={path}: {file.name}", "the file is damaged or not safetensors; copy it again"):
        reader = safe_open(str(file), framework="pt")
    with reader:
        yield reader


def expected_hf_shapes(model_cfg, names: HFNames = HFNames()) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name -> shape, for the whole model the config describes (built on the meta device)."""
    from speedllm.models.qwen3 import Qwen3

    with torch.device("meta"):
        model = Qwen3(model_cfg)
    return {name: tuple(t.shape) for name, t in to_hf_state_dict(model.state_dict(), model_cfg, names).items()}


def _names(items: Iterable[str], limit: int = 5) -> str:
    items = sorted(items)
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_hf_files(path: str, model_cfg, files: Dict[str, Path]) -> None:
    """Every tensor the config implies is there with its shape, and nothing else (reads headers only)."""
    expected = expected_hf_shapes(model_cfg, hf_names_of(files))
    missing = expected.keys() - files.keys()
    if missing:
        raise UserError(f"checkpoint.load_hf={path}: {len(missing)} tensor(s) missing: {_names(missing)}; the "
                        "directory does not hold every weight its config.json describes")
    unexpected = {n for n in files.keys() - expected.keys() if not n.endswith("rotary_emb.inv_freq") and
                  not is_extra(n)}
    if unexpected:
        raise UserError(f"checkpoint.load_hf={path}: unexpected tensor(s) {_names(unexpected)} are not part of "
                        "the model its config.json describes; fix config.json or remove them")
    for file in sorted(set(files.values())):
        with _open_safetensors(path, file) as reader:
            for name in reader.keys():
                if name not in expected:
                    continue
                actual = tuple(reader.get_slice(name).get_shape())
                if actual != expected[name]:
                    raise UserError(f"checkpoint.load_hf={path}: tensor {name} in {file.name} has shape "
                                    f"{list(actual)} but config.json implies {list(expected[name])}")
                dtype = reader.get_slice(name).get_dtype()
                if not dtype.startswith(("F", "BF")):  # an integer weight would be cast silently
                    raise UserError(f"checkpoint.load_hf={path}: tensor {name} in {file.name} is {dtype}, not a "
                                    "floating-point type; these are not model weights")


def local_slices(tensor: torch.Tensor) -> Tuple[slice, ...]:
    """The block of the global tensor this rank holds (all of it for a plain tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _sources(name: str, shape, model_cfg, names: HFNames) -> List[str]:
    """The HF tensors one of our tensors is made of (one, or one per expert stacked on dim 0)."""
    if name == "lm_head.weight" and model_cfg.tie_word_embeddings:
        return [f"{names.prefix}embed_tokens.weight"]
    if names.fused_experts and name.endswith((".experts.gate_proj", ".experts.up_proj")):
        return [name.rsplit(".", 1)[0].replace("layers.", f"{names.prefix}layers.", 1) + ".gate_up_proj"]
    return list(to_hf_state_dict({name: torch.empty(shape, device="meta")}, model_cfg, names))


def _modules(model) -> List[nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


@torch.no_grad()
def load_hf_weights(model, path: str) -> None:
    """Load an HF Qwen3 / Qwen3-MoE directory into `model` in place, whatever its parallel layout.

    Args:
        model: a Qwen3 (possibly FSDP2/TP-wrapped, or a pipeline stage holding some layers), or a list of
            them (several pipeline chunks on this rank); its `cfg` must match the directory's config.json.
        path: HF model directory.
    Each tensor is read as this rank's slice only and converted to the parameter's dtype.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    modules = _modules(model)
    model_cfg = modules[0].cfg
    read_hf_config(path)
    files = weight_files(path)
    check_hf_files(path, model_cfg, files)
    with hf_reader(path, model_cfg, files) as read:
        for module in modules:
            # QLoRA's NF4 base: quantized from the whole tensor, as in one process (speedllm.quant.nf4)
            nf4 = {unwrapped(name): p for name, p in module.named_parameters() if is_nf4(p)}
            for name, param in nf4.items():
                fill_nf4_(param, read(name, param.shape, tuple(slice(0, n) for n in param.shape)))
            state = get_model_state_dict(module)
            for name, target in state.items():
                if is_adapter(name) or name in nf4:  # LoRA adapters are not part of the base model
                    continue
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(read(name, target.shape, local_slices(target)))
            set_model_state_dict(module, {k: v for k, v in state.items() if k not in nf4},
                                 options=StateDictOptions(strict=not nf4))


@contextmanager
def hf_reader(path: str, model_cfg, files: Dict[str, Path]):
    """read(name, shape, index) -> the `index` slice of our tensor `name` (of full `shape`), from the HF files;
    each file stays memory-mapped (and its pages read so far resident) until the context exits."""
    from safetensors import safe_open

    names = hf_names_of(files)
    with ExitStack() as stack:
        readers = {}

        def read_hf(hf_name: str, index: Tuple[slice, ...]) -> torch.Tensor:
            file = files[hf_name]
            if file not in readers:
                readers[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return readers[file].get_slice(hf_name)[index]

        def read(name: str, shape, index: Tuple[slice, ...]) -> torch.Tensor:
            sources = _sources(name, shape, model_cfg, names)
            if sources[0].endswith(".gate_up_proj"):  # fused experts: gate_proj the first half of dim 1, up_proj
                half = shape[1] if name.endswith(".up_proj") else 0
                return read_hf(sources[0], (index[0], slice(index[1].start + half, index[1].stop + half), index[2]))
            if has_qkv_rows(name):  # Gated DeltaNet q, k, v rows: ours are HF's in another order, read in runs
                rows = qkv_channels(model_cfg)[index[0]]
                runs = torch.tensor_split(rows, (torch.diff(rows) != 1).nonzero().squeeze(1) + 1)
                return torch.cat([read_hf(sources[0], (slice(int(r[0]), int(r[-1]) + 1), *index[1:])) for r in runs])
            if len(sources) == 1:
                return read_hf(sources[0], index)
            # stacked experts [E, out, in]: the experts of index[0], each its own HF tensor; none when FSDP2
            # shards fewer experts than ranks by rows (5 over 4 ranks: 2, 2, 1 and 0)
            experts = range(index[0].start, index[0].stop)
            if not experts:
                return torch.empty(0, *(s.stop - s.start for s in index[1:]))
            return torch.stack([read_hf(sources[e], index[1:]) for e in experts])

        yield read


# ----------------------------------------------------------------------------------------- writing

def parse_size(text) -> int:
    """'5GB', '500MB', '2GiB', '100KB' or a number of bytes -> bytes (GB = 10^9, GiB = 2^30, as transformers)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in units:
        raise UserError(f"convert.max_shard_size={text} is not a size; use e.g. 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * units[match.group(2).upper()])


def _layer_order(name: str):
    """Model order: embeddings, layers by number, final norm, lm_head (not the string order of 'layers.10')."""
    match = re.match(r"layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if name.startswith("embed_tokens") else 2 if name.startswith("norm") else 3, 0, name)


def plan_shards(tensors: Dict[str, Tuple[tuple, torch.dtype]], max_bytes: int, together=lambda name: False
                ) -> List[List[str]]:
    """Group our tensor names into shards of at most max_bytes each (a larger tensor gets a shard of its own);
    a name for which `together` holds stays in the shard of the name before it."""
    shards, current, size = [], [], 0
    for name in sorted(tensors, key=_layer_order):
        shape, dtype = tensors[name]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if current and size + nbytes > max_bytes and not together(name):
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _describes(model_cfg, source: Optional[Path]) -> bool:
    """Whether `source` holds a config.json describing this model (then it is kept, with its naming and extras)."""
    return source is not None and (source / "config.json").is_file() and not config_mismatches(model_cfg, str(source))


def _config_json(model_cfg, source: Optional[Path], dtype: torch.dtype) -> dict:
    """The source's own config.json when it describes this model (every field kept), else one from our config."""
    dtype_name = str(dtype).removeprefix("torch.")
    config = json.loads((source / "config.json").read_text()) if _describes(model_cfg, source) else \
        hf_config(model_cfg).to_dict()
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = dtype_name
    if "text_config" in config:  # a release: its text part says the dtype too
        config["text_config"]["dtype"] = dtype_name
    return config


NAMES_FILE = "hf_names.json"  # beside a converted checkpoint's copy of the HF config: how the directory named tensors


def source_names(source: Path) -> HFNames:
    """How HF directory `source` (or a converted checkpoint's `hf/` copy of its files) names the text model."""
    if (source / NAMES_FILE).is_file():
        return HFNames(**json.loads((source / NAMES_FILE).read_text()))
    if has_weights(source):
        return hf_names_of(weight_files(str(source)))
    return HFNames()  # a checkpoint converted before the naming was kept: a Qwen3 causal LM's


RELEASE_DIR = "hf"  # a checkpoint's copy of its release's files (config.json, tokenizer, naming)
EXTRAS_DIR = "hf_extras"  # a checkpoint's release tensors beside the text model, as safetensors


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def write_release(source: Optional[str], step_dir) -> None:
    """Keep what of release `source` is not our model in checkpoint `step_dir`, unchanged: hf/ (config.json,
    generation_config.json, tensor naming, tokenizer files) and hf_extras/ (the vision tower and MTP tensors as
    safetensors, one source shard in memory at a time). `source` is an HF directory, or a checkpoint that keeps
    them (copied file by file); both and `step_dir` may be URLs (a checkpoint's), an HF directory only local."""
    from safetensors.torch import save

    def target(folder: str, name: str):
        if not storage.is_url(step_dir):
            Path(step_dir, folder).mkdir(exist_ok=True)
        return storage.open_file(storage.join(step_dir, folder, name), "wb")

    if source is None:
        return
    if storage.list_names(storage.join(source, RELEASE_DIR)):  # a checkpoint that keeps them
        for folder in (RELEASE_DIR, EXTRAS_DIR):
            for name in storage.list_names(storage.join(source, folder)):
                with storage.open_file(storage.join(source, folder, name), "rb") as src, target(folder, name) as dst:
                    shutil.copyfileobj(src, dst, 1 << 24)
        return
    if storage.is_url(source) or not has_weights(Path(source)) or not (Path(source) / "config.json").is_file():
        return
    files = weight_files(source)
    names = hf_names_of(files)
    with target(RELEASE_DIR, NAMES_FILE) as f:
        f.write((json.dumps({"prefix": names.prefix, "fused_experts": names.fused_experts}) + "\n").encode())
    for name in ("config.json", "generation_config.json", *TOKENIZER_FILES):
        if (Path(source) / name).is_file():
            with open(Path(source) / name, "rb") as src, target(RELEASE_DIR, name) as dst:
                shutil.copyfileobj(src, dst)
    for file in sorted({files[name] for name in files if is_extra(name)}):
        with _open_safetensors(source, file) as reader:
            tensors = {name: reader.get_tensor(name) for name in reader.keys() if is_extra(name)}
        with target(EXTRAS_DIR, file.name) as f:
            f.write(save(tensors, metadata={"format": "pt"}))


def read_extras(source: str, files: Optional[Dict[str, Path]] = None) -> Dict[str, torch.Tensor]:
    """The tensors of HF directory `source` that are not the text model (vision tower, MTP head), as stored."""
    files = weight_files(source) if files is None else files
    extras = {}
    for file in sorted({files[name] for name in files if is_extra(name)}):
        with _open_safetensors(source, file) as reader:
            extras.update({name: reader.get_tensor(name) for name in reader.keys() if is_extra(name)})
    return extras


def _token_ids(tokenizer_dir: Path, vocab_size: int) -> dict:
    """bos/eos/pad ids for config.json, and the ids generation stops at (eos, end of turn, end of text): those of
    the tokenizer's ids the model's vocabulary has."""
    from speedllm.data.tokenizer import load_tokenizer, pad_id_of, stop_ids_of

    tok = load_tokenizer(str(tokenizer_dir))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": pad_id_of(tok)}
    ids = {key: i for key, i in ids.items() if i is not None and i < vocab_size}
    return {**ids, "stop_ids": [i for i in stop_ids_of(tok) if i < vocab_size]}


def _write_generation_config(tmp: Path, config: dict, ids: dict, source: Optional[Path]) -> None:
    """The source's generation_config.json, else one that stops where our generate stops (greedy by default)."""
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copy2(source / "generation_config.json", tmp / "generation_config.json")
        return
    from transformers import GenerationConfig

    stops = ids.get("stop_ids") or ([config["eos_token_id"]] if config.get("eos_token_id") is not None else None)
    GenerationConfig(bos_token_id=config.get("bos_token_id"), pad_token_id=config.get("pad_token_id"),
                     eos_token_id=stops).save_pretrained(tmp)


def _honour_umask(root: Path) -> None:
    """safetensors writes 0600 files; give every file the mode the user's umask asks for."""
    mask = os.umask(0)
    os.umask(mask)
    for path in root.iterdir():
        path.chmod(0o666 & ~mask)
    root.chmod(0o777 & ~mask)


def write_hf_dir(out: str, model_cfg, tensors: Dict[str, Tuple[tuple, torch.dtype]],
                 fetch: Callable[[List[str]], Dict[str, torch.Tensor]], max_shard_size="5GB",
                 dtype: Optional[torch.dtype] = None, source: Optional[str] = None,
                 tokenizer: Optional[str] = None, progress: bool = True,
                 extras: Optional[Dict[str, torch.Tensor]] = None) -> Path:
    """Write an HF model directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Args:
        tensors: our state-dict name -> (shape, dtype), the whole model.
        fetch: loads a list of our names as full tensors (called once per shard, so memory stays ~one shard).
        dtype: dtype of the written weights (None: each tensor's own).
        source: directory with the original config.json / generation_config.json / tokenizer files, reused
            verbatim when it describes this model; its tensor names and extras (vision tower, MTP) too.
        tokenizer: tokenizer directory, when `source` has no tokenizer files.
        extras: the tensors beside the text model, written as they are (None: the source directory's).
    Written to `.<out>.tmp` and renamed to `out` when complete; `out` must not exist or be empty.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise UserError(f"convert.out={out} exists and is not empty; choose a new directory or remove it")
    source_path = Path(source) if source is not None else None
    keep = _describes(model_cfg, source_path)
    names = source_names(source_path) if keep else HFNames()
    if extras is None:
        extras = read_extras(source) if keep and has_weights(source_path) else {}
    tmp = make_scratch_dir(out_path.parent / f".{out_path.name}.tmp", "convert.out")
    if model_cfg.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    tensors = {k: (shape, dtype or t_dtype) for k, (shape, t_dtype) in tensors.items()}
    # the extras keep their own dtype: nothing here computes with them
    all_tensors = {**tensors, **{k: (tuple(t.shape), t.dtype) for k, t in extras.items()}}
    shards = plan_shards(all_tensors, parse_size(max_shard_size),
                         lambda name: names.fused_experts and name.endswith(".experts.up_proj"))
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in all_tensors.values())
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing safetensors", disable=not progress) as bar:
        for i, shard_names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            group = [k for k in shard_names if k in tensors]
            ours = {k: v.to(tensors[k][1]) for k, v in fetch(group).items()} if group else {}
            # unbound experts share their stack's storage, which safetensors refuses: give each its own
            shard = {k: v.detach().to("cpu").clone() for k, v in to_hf_state_dict(ours, model_cfg, names).items()}
            shard.update({k: extras[k].contiguous() for k in shard_names if k in extras})
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
            bar.update(sum(torch.Size(all_tensors[k][0]).numel() * all_tensors[k][1].itemsize for k in shard_names))
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    copy_tokenizer(source if source_path and has_tokenizer(source) else tokenizer, tmp)
    config = _config_json(model_cfg, source_path, tensors["embed_tokens.weight"][1])
    ids = _token_ids(tmp, model_cfg.vocab_size) if has_tokenizer(str(tmp)) else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is None and ids.get(key) is not None:
            config[key] = ids[key]
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_generation_config(tmp, config, ids, source_path)
    if out_path.exists():
        out_path.rmdir()  # empty (checked above)
    (tmp / MARKER).unlink()  # the finished directory is the user's
    _honour_umask(tmp)
    os.replace(tmp, out_path)
    return out_path


def has_tokenizer(path: Optional[str]) -> bool:
    return path is not None and any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def copy_tokenizer(src: Optional[str], dst: Path) -> None:
    """Copy the tokenizer files of `src` (an HF model or tokenizer directory) into `dst`."""
    if src is None:
        return
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)


def export_model(model: nn.Module, out: str, max_shard_size="5GB", dtype: Optional[torch.dtype] = None,
                 source: Optional[str] = None, tokenizer: Optional[str] = None, progress: bool = True) -> Path:
    """Write a single-process (unsharded) Qwen3 as an HF directory; see write_hf_dir."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    tensors = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    return write_hf_dir(out, model.cfg, tensors, lambda names: {k: state[k] for k in names}, max_shard_size,
                        dtype, source, tokenizer, progress)
