"""What a run reads: optional packages (extras), paths, a Hugging Face config.json, an inference task's weights
and prompts, and the per-task files (GRPO's rewards and prompts, distill's teacher).
"""

import importlib.util
import os
from glob import glob

from omegaconf import DictConfig, OmegaConf

from speedllm.config.values import _finite
from speedllm.errors import UserError
from speedllm.parallel.rules import distill_layout_errors, layout_errors


# (what needs it, module, extra): a choice that imports an optional package, checked before anything runs
def _extras(cfg: DictConfig):
    if cfg.quant.name != "none":
        yield f"quant={cfg.quant.name}", "torchao", "quant"
    if cfg.finetune.name == "qlora":
        yield "finetune=qlora", "torchao", "finetune"
    if cfg.task.name == "serve":
        yield "task=serve", "fastapi", "serve"
        yield "task=serve", "uvicorn", "serve"
    if cfg.task.name == "evaluate" and cfg.evaluate.tasks:
        yield "evaluate.tasks", "lm_eval", "eval"
    if cfg.task.name == "distill" and cfg.distill.teacher_quant != "none":
        yield f"distill.teacher_quant={cfg.distill.teacher_quant}", "torchao", "quant"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def check_extras(cfg: DictConfig) -> None:
    for what, module, extra in _extras(cfg):
        if not _installed(module):
            raise UserError(f"{what} needs {module}, which is not installed: pip install 'speedllm[{extra}]' "
                            f"(from a checkout: pip install -e '.[{extra}]')")


def _must_exist(key: str, path: str, fix: str) -> None:
    from speedllm import storage

    if storage.is_url(path):
        return storage.check(key, path, must_exist=True)
    if not (os.path.exists(path) or glob(path)):
        raise UserError(f"{key}={path} does not exist; {fix}")


def check_paths(cfg: DictConfig) -> None:
    ck, d, task = cfg.checkpoint, cfg.data, cfg.task.name
    if ck.load not in (None, "auto"):
        _must_exist("checkpoint.load", ck.load, "point it at a checkpoint directory (or use checkpoint.load=auto)")
    if ck.load_hf is not None:
        _must_exist("checkpoint.load_hf", ck.load_hf, "point it at a Hugging Face model directory")
    if task != "doctor":
        _must_exist("data.tokenizer", d.tokenizer, "point it at a Hugging Face tokenizer directory")
    if task == "preprocess":
        if d.input is None or d.output_prefix is None:
            raise UserError("task=preprocess needs data.input=<file or glob> and data.output_prefix=<prefix>")
        for item in [d.input] if isinstance(d.input, str) else d.input:
            _must_exist("data.input", item, "give a file, a glob or a list of them")
    if d.path is not None and task in ("pretrain", "distill", "evaluate"):
        items = [d.path] if isinstance(d.path, str) else list(d.path)
        for prefix in items[1::2] if len(items) > 1 else items:
            for suffix in (".bin", ".idx"):
                _must_exist("data.path", f"{prefix}{suffix}", "give the prefix of a .bin/.idx pair "
                            "(e.g. made by task=preprocess)")
    if cfg.generate.prompts_file is not None and task == "generate":
        _must_exist("generate.prompts_file", cfg.generate.prompts_file, "one prompt per line, or jsonl")
    if task == "convert":
        if cfg.convert.out is None:
            raise UserError("task=convert needs convert.out=<output directory>")
        source = ck.load_hf if cfg.convert.to == "dcp" else ck.load
        if source is None:
            need = "checkpoint.load_hf=<HF dir>" if cfg.convert.to == "dcp" else "checkpoint.load=<checkpoint dir>"
            raise UserError(f"task=convert convert.to={cfg.convert.to} needs {need}")


def check_hf_model(cfg: DictConfig) -> None:
    """model=hf needs checkpoint.load_hf; any other model= must agree with the config.json it loads.

    Runs first: model=hf's fields are read from that config.json when anything looks at them.
    """
    from speedllm.checkpoint.hf import config_mismatches, read_hf_config

    load_hf, name = cfg.checkpoint.load_hf, cfg.model.name
    if name == "hf" and load_hf is None:
        raise UserError("model=hf takes the model from checkpoint.load_hf's config.json; set "
                        "checkpoint.load_hf=<HF model dir>")
    if load_hf is None:
        return
    _must_exist("checkpoint.load_hf", load_hf, "point it at a Hugging Face model directory")
    read_hf_config(load_hf)
    # task=convert takes the model from its source, whatever model= says
    mismatches = [] if name == "hf" or cfg.task.name == "convert" else config_mismatches(cfg.model, load_hf)
    if mismatches:
        raise UserError(f"checkpoint.load_hf={load_hf}: config.json disagrees with model={name} on "
                        f"{', '.join(mismatches)} (config.json vs model); use model=hf to take the model from "
                        "config.json, or the matching model=")


def check_inputs(cfg: DictConfig) -> None:
    """What an inference task reads: weights, and for task=generate prompts (checked after every value rule)."""
    gen = cfg.generate
    if cfg.task.name == "generate" and gen.prompt is None and gen.prompts_file is None:
        raise UserError("task=generate needs generate.prompt=<text> or generate.prompts_file=<path>")
    if cfg.checkpoint.load is None and cfg.checkpoint.load_hf is None:
        raise UserError(f"task={cfg.task.name} needs weights: checkpoint.load=<checkpoint dir> (from a training "
                        "run) or checkpoint.load_hf=<Hugging Face model dir> (with model=hf)")


def check_distill(cfg: DictConfig) -> None:
    """task=distill: its layout, the settings that have no finite loss, and the teacher (speedllm.train.teacher)."""
    from speedllm.train.teacher import check_teacher

    d, p = cfg.distill, cfg.parallel
    for error in distill_layout_errors(pp=p.pp, cp=p.cp, tp=p.tp, dp=p.dp, fsdp=p.fsdp, teacher_quant=d.teacher_quant,
                                       teacher_parallel=d.teacher_parallel, name=p.name):
        raise UserError(error)
    if d.top_k is not None and d.top_k > cfg.model.vocab_size:
        raise UserError(f"distill.top_k={d.top_k} exceeds the vocabulary ({cfg.model.vocab_size}); use a smaller k, "
                        "or distill.top_k=null for the whole distribution")
    reverse = d.loss == "reverse_kl" or d.loss == "jsd" and d.beta == 1
    if d.top_k is not None and reverse:
        raise UserError(f"distill.top_k={d.top_k} with the reverse KL (distill.loss={d.loss}, beta={d.beta}) is "
                        "infinite where the student puts mass outside the teacher's top k; use distill.top_k=null, or "
                        "distill.loss=forward_kl|jsd with beta < 1")
    source = check_teacher(cfg)
    errors = layout_errors(source.model, tp=p.tp, pp=1, vpp=1, ep=p.ep, cp=1, dp=p.dp, schedule=p.pp_schedule,
                           sequence_parallel=p.sequence_parallel)
    if errors:
        raise UserError(f"distill.teacher={d.teacher}: {errors[0]}")


def check_rl(cfg: DictConfig) -> None:
    """task=grpo: the rl settings against each other and the layout, the reward functions, and the prompts (read
    and tokenized here, so a bad record stops the run before any rank starts)."""
    from hydra.utils import get_method

    rl, p = cfg.rl, cfg.parallel
    if rl.group_size < 2:
        raise UserError(f"rl.group_size={rl.group_size}: every advantage would be zero (a reward minus the mean of "
                        "its own group); use rl.group_size >= 2")
    for key in ("prompts_per_step", "max_new_tokens", "ppo_epochs", "mini_batches"):
        if rl[key] < 1:
            raise UserError(f"rl.{key}={rl[key]} must be at least 1")
    for key in ("overlong_buffer", "max_resample"):
        if rl[key] < 0:
            raise UserError(f"rl.{key}={rl[key]} must be >= 0")
    if p.pp > 1 or p.cp > 1:
        raise UserError(f"task=grpo does not run on pipeline stages or context-parallel ranks (parallel.pp={p.pp}, "
                        f"parallel.cp={p.cp}); use parallel.pp=1 and parallel.cp=1 (tp, ep and dp split it)")
    if rl.prompts_per_step % p.dp:
        raise UserError(f"rl.prompts_per_step={rl.prompts_per_step} must be divisible by parallel.dp={p.dp} (each "
                        f"data-parallel rank samples its share); use a multiple of {p.dp}")
    rows = rl.prompts_per_step // p.dp * rl.group_size
    if rows % rl.mini_batches:
        raise UserError(f"rl.mini_batches={rl.mini_batches} must divide the {rows} completions of a rank "
                        f"(rl.prompts_per_step / parallel.dp x rl.group_size)")
    if rl.router_replay and not cfg.model.num_experts:
        raise UserError(f"rl.router_replay=true: model {cfg.model.name} has no experts; leave rl.router_replay unset")
    if cfg.model.num_experts and rl.router_replay is not False and p.tp > 1:
        raise UserError(f"rl.router_replay under parallel.tp={p.tp}: the MoE blocks route sequence shards; set "
                        "rl.router_replay=false or use expert parallelism (parallel.ep) instead of tp")
    if rl.rollout_correction != "none" and rl.old_logprobs != "recompute":
        raise UserError(f"rl.rollout_correction={rl.rollout_correction} weighs the training forward's old "
                        "log-probabilities against the rollout's; add rl.old_logprobs=recompute")
    if rl.overlong_buffer > rl.max_new_tokens:
        raise UserError(f"rl.overlong_buffer={rl.overlong_buffer} exceeds rl.max_new_tokens={rl.max_new_tokens}; "
                        "use a smaller buffer")
    if not rl.rewards:
        raise UserError("task=grpo needs reward functions: rl.rewards=[{_target_: module.fn, weight: 1.0}]")
    for key, i, entry in [("rewards", i, e) for i, e in enumerate(rl.rewards)] + \
            [("tools", i, e) for i, e in enumerate(rl.tools)]:
        if not OmegaConf.is_dict(entry) or "_target_" not in entry:
            raise UserError(f"rl.{key}[{i}]={entry} needs _target_: module.fn"
                            + (" (and optionally weight)" if key == "rewards" else ""))
        try:
            get_method(entry["_target_"])
        except Exception as e:  # hydra wraps import and attribute errors alike
            raise UserError(f"rl.{key}[{i}]._target_={entry['_target_']} cannot be imported "
                            f"({str(e).splitlines()[0]}); name a function module.fn on the Python path") from None
        if key == "rewards" and not _finite(entry.get("weight", 1.0)):
            raise UserError(f"rl.rewards[{i}].weight={entry.get('weight')} must be a finite number")
    if cfg.data.input is None:
        raise UserError("task=grpo needs data.input=<json/jsonl of {prompt, ...} records> (or data=rl_demo)")
    from speedllm.data.prompts import load_prompts
    from speedllm.data.tokenizer import load_tokenizer
    from speedllm.models.rope import max_positions
    from speedllm.train.tools import build_tools, tool_schemas

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    if rl.tools and tokenizer.convert_tokens_to_ids("</tool_call>") in (None, tokenizer.unk_token_id):
        raise UserError(f"rl.tools: the tokenizer {cfg.data.tokenizer} has no </tool_call> token to end a call; use a "
                        "Qwen3 tokenizer or leave rl.tools empty")
    load_prompts(cfg.data.input, tokenizer, max_positions(cfg.model) - rl.max_new_tokens, rl.max_new_tokens,
                 tool_schemas(build_tools(rl.tools)))
