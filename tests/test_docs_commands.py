"""Every command line of the docs runs as a user types it (README.md and docs/**/*.md), in a cheap form.

Which lines are commands: a line inside a ``` code block (any language but `yaml`/`python`/`json`) that starts with
`python launch.py`, `speedllm `, `torchrun `, `python -m benchmarks` or `python benchmarks/`, optionally after
`VAR=value` environment assignments; a line ending in `\\` continues on the next. A trailing `# comment` is a
comment; `# exit N` in it says the command is documented to exit with N (default 0). The docs are read when the
tests are collected, so a page another change adds is tested without touching this file.

Placeholders in angle brackets stand for files the reader has; the test makes them (tiny, once per session):
`<run>` a pretraining run dir (its checkpoints under `<run>/checkpoints`), `<lora run>` a LoRA SFT run on `<HF dir>`,
`<HF dir>` a tiny Qwen3 saved by transformers with the demo tokenizer (`<Qwen3-MoE dir>`, `<Qwen3.5 dir>`: a tiny
Qwen3-MoE, a tiny Qwen3.5 of two Gated DeltaNet layers and a gated attention one), `<PEFT dir>` that LoRA run's PEFT
export, `<tokenizer dir>` the demo tokenizer, `<out dir>` a fresh folder for outputs. Relative input files the docs name
(`pairs.jsonl`, `prompts.jsonl`, `corpus/*.jsonl`, `data/{corpus,web,books}`, `my_tasks/`) lie in the folder the
commands run from (each command gets its own copy). A placeholder not in this list fails the test: make it in `_substitute`.

The cheap form of a command is the command as typed plus overrides appended at the end (Hydra takes the last value
of a key), chosen from the composed config:
- `task=plan`, `task=dryrun`, `--cfg ...` and `--help`: as typed (they are cheap at any size);
- a run this machine cannot hold (more than 2 ranks, a model wider than 512, a GPU/NPU hardware profile): `task=dryrun`
  (validation, then every simulated rank built with the real `parallelize` on meta tensors);
- pretrain / sft / dpo / distill: 2 steps of 4 x 32 tokens, no samples (TRAIN_CHEAP); grpo: 2 steps of 2 x 2
  completions of 4 tokens; generate / chat: 4 new tokens (chat reads `/exit`); evaluate: 1 batch, or 2 samples per
  lm-eval task; suites that must be downloaded (lm-eval tasks
  without `evaluate.include_path`): `--cfg job`;
- serve: started on a free port, then asked for `/health` until it answers 200, then SIGTERM to the launcher: it
  must exit 0;
- `-m` sweeps: every point in its cheap form; `hydra/launcher=submitit_slurm`: skipped where the plugin is missing;
- benchmarks: `python -m benchmarks <name> <flags>` is parsed by the benchmark's own parser (`--parse-only`, in this
  process): the code behind it is what tests/test_benchmarks.py runs in each benchmark's dry form, with its table
  checked; a bare `python -m benchmarks <name>` is left to that test. A command with a `--` that hands the rest to
  launch.py, or a script under `benchmarks/`, runs with `--dry` (or `--help` where a script has no dry form).
A command documented to fail (`# exit N`, N > 0) runs as typed: it is refused before anything runs.
Each command must exit with its documented code and print neither `internal error` nor `Traceback`.
README.md stays a quickstart: at most 200 lines. Benchmarks, servers, lm-eval, sweeps and 2-rank runs are `slow`.
"""

import fcntl
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speedllm.paths import ASSETS, ROOT

pytestmark = pytest.mark.unit

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"^((?:[A-Z_][A-Z0-9_]*=\S+\s+)*)(python launch\.py|speedllm|torchrun|python -m benchmarks|"
                     r"python benchmarks/)(\s|$)")
TRAIN_CHEAP = ["train.steps=2", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
               "train.eval_every=0", "generate.num_samples=0"]
# sft's rows hold a chat template's system prompt (alpaca's instruction) before the trained reply
TASK_CHEAP = {"pretrain": TRAIN_CHEAP, "sft": [*TRAIN_CHEAP, "train.seq_len=64"], "dpo": TRAIN_CHEAP, "distill": TRAIN_CHEAP,
              "grpo": ["train.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=4"],
              "generate": ["generate.max_new_tokens=4"], "chat": ["generate.max_new_tokens=4"],
              "evaluate": ["evaluate.steps=1", "evaluate.limit=2"], "serve": ["serve.max_len=128"]}
DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
TIMEOUT = 600


def doc_commands() -> list:
    """(page, line number, command) for every command line of the docs, first occurrence of each command."""
    found = {}
    for page in DOCS:
        in_block, skip, pending = False, False, None
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_block = not in_block
                skip = in_block and line.strip()[3:].strip() in ("yaml", "python", "json")
                continue
            if not in_block or skip:
                continue
            if pending is not None:
                pending = (pending[0], pending[1] + " " + line.strip())
            elif COMMAND.match(line.strip()):
                pending = (number, line.strip())
            if pending is not None and not pending[1].endswith("\\"):
                found.setdefault(_without_comment(pending[1].replace("\\ ", " ")),
                                 (page.relative_to(ROOT).as_posix(), pending[0]))
                pending = None
    return [(page, number, command) for command, (page, number) in found.items()]


def _without_comment(command: str) -> str:
    """The command without its trailing comment, but for an `# exit N` comment."""
    code = re.search(r"#\s*exit (\d+)", command)
    return re.sub(r"\s+#.*$", "", command) + (f"  # exit {code.group(1)}" if code else "")


COMMANDS = doc_commands()


def test_readme_is_a_quickstart():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference material into docs/"


def test_docs_name_only_pages_that_exist():
    """Every relative link of the docs points at a file of the repository."""
    missing = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory, save_tiny_hf, launch_py):
    """The files the placeholders name, made once per session (shared by the xdist workers through a lock)."""
    root = tmp_path_factory.getbasetemp()
    base = (root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / "docs_commands"
    base.mkdir(exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "done").exists():
            _make_artifacts(base, save_tiny_hf, launch_py)
            (base / "done").touch()
    return base


def _make_artifacts(base: Path, save_tiny_hf, launch_py) -> None:
    from speedllm.data.tokenizer import load_tokenizer

    def _launch(cwd, *overrides):
        proc = launch_py(overrides, cwd, timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    for entry in base.iterdir():  # what a worker that failed here left
        if entry.name != ".lock":
            shutil.rmtree(entry)
    work = base / "work"
    work.mkdir()
    # wide enough for int4 groups of 128 (quant.group_size must divide every projection's input width)
    save_tiny_hf(base / "hf", seed=3, vocab_size=len(load_tokenizer(str(DEMO_TOKENIZER))), tie_word_embeddings=True,
                 hidden_size=128, intermediate_size=256, head_dim=32)
    save_tiny_hf(base / "hf_moe", seed=3, vocab_size=len(load_tokenizer(str(DEMO_TOKENIZER))), num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=64)
    _save_qwen3_5(base / "hf_qwen3_5")
    _launch(work, f"hydra.run.dir={base / 'run'}", *TRAIN_CHEAP)
    _launch(work, "task=sft", "model=hf", f"checkpoint.load_hf={base / 'hf'}", "finetune=lora",
            f"hydra.run.dir={base / 'lora_run'}", *TRAIN_CHEAP)
    _launch(work, "task=convert", f"checkpoint.load={base / 'lora_run' / 'checkpoints'}", "convert.to=peft",
            f"convert.out={base / 'peft'}")
    # the relative files the docs' commands read
    messages = [json.loads(line) for line in (ASSETS / "sft_demo" / "messages.jsonl").read_text().splitlines()[:8]]
    with open(work / "pairs.jsonl", "w") as f:
        for record in messages:
            prompt, answer = record["messages"][-2]["content"], record["messages"][-1]["content"]
            f.write(json.dumps({"prompt": prompt, "chosen": answer, "rejected": answer[::-1]}) + "\n")
    with open(work / "prompts.jsonl", "w") as f:
        for prompt in ("ROMEO:", "JULIET:"):
            f.write(json.dumps({"prompt": prompt}) + "\n")
    (work / "corpus").mkdir()
    with open(work / "corpus" / "part0.jsonl", "w") as f:
        for n in range(20):
            f.write(json.dumps({"text": f"To be, or not to be, that is the question {n}."}) + "\n")
    _launch(work, "task=preprocess", "data.input=corpus/*.jsonl", "data.output_prefix=data/corpus",
            f"data.tokenizer={DEMO_TOKENIZER}")
    for name in ("web", "books"):  # the two data sets of the weighted-blend example
        for suffix in (".bin", ".idx", ".json"):
            shutil.copy(work / "data" / f"corpus{suffix}", work / "data" / f"{name}{suffix}")
    shutil.rmtree(work / "outputs", ignore_errors=True)
    (work / "my_tasks").mkdir()
    (work / "my_tasks" / "my_task.jsonl").write_text("".join(
        json.dumps({"question": f"{a} + {a}?", "choices": [str(2 * a), str(2 * a + 1)], "answer": 0}) + "\n"
        for a in range(4)))
    (work / "my_tasks" / "my_task.yaml").write_text(
        "task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: my_tasks/my_task.jsonl\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save_qwen3_5(path: Path) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               layer_types=["linear_attention", "linear_attention", "full_attention"],
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    Qwen3_5ForCausalLM(config).save_pretrained(path)
    for file in DEMO_TOKENIZER.iterdir():
        shutil.copy(file, path / file.name)


def _substitute(command: str, artifacts: Path, tmp_path: Path) -> str:
    paths = {"<run>": tmp_path / "run", "<lora run>": tmp_path / "lora_run", "<HF dir>": artifacts / "hf",
             "<Qwen3-MoE dir>": artifacts / "hf_moe", "<Qwen3.5 dir>": artifacts / "hf_qwen3_5",
             "<PEFT dir>": artifacts / "peft", "<tokenizer dir>": DEMO_TOKENIZER, "<out dir>": tmp_path / "out"}
    unknown = set(re.findall(r"<[^<>]+>", command)) - set(paths)
    assert not unknown, f"placeholders {sorted(unknown)} are not made by this test: make them in _substitute"
    for name, run in (("<run>", "run"), ("<lora run>", "lora_run")):
        if name in command:  # a run resumed or read gets its own copy
            shutil.copytree(artifacts / run, tmp_path / run)
    for name, path in paths.items():
        command = command.replace(name, str(path))
    return command


def _compose(overrides: list):
    from speedllm.config import compose_config

    return compose_config(*[o for o in overrides if not o.startswith(("hydra", "-"))])


def _too_big_for_here(cfg) -> bool:
    """More than 2 ranks, a model wider than 512, or a device profile other than the CPU."""
    p, launcher = cfg.parallel, cfg.launcher
    world = launcher.nnodes * launcher.nproc_per_node if launcher.nproc_per_node > 0 else \
        max(p.dp, 1) * p.tp * p.pp * p.cp
    return world > 2 or cfg.model.hidden_size > 512 or cfg.hardware.device != "cpu"


def _cheap_launch(args: list, tmp_path: Path) -> tuple:
    """(extra arguments, mode) for a launch.py / speedllm / torchrun command line's arguments."""
    if any(a.startswith(("--cfg", "--help", "--info")) for a in args):
        return [], "run"
    multirun = "-m" in args or "--multirun" in args
    if any(a.startswith("hydra/launcher=submitit") for a in args):
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = [a for a in args if not a.startswith("-")]
    cfg = _compose([a.split(",")[0] if multirun else a for a in sweep])
    task = cfg.task.name
    if task in ("plan", "dryrun"):
        return [], "run"
    if _too_big_for_here(cfg):
        return ["task=dryrun"], "run"
    if task == "evaluate" and cfg.evaluate.tasks and not cfg.evaluate.include_path:
        return ["--cfg", "job"], "run"
    extra = list(TASK_CHEAP.get(task, []))
    if not any(a.startswith("hydra.run.dir=") for a in args):
        extra.append(f"hydra.sweep.dir={tmp_path / 'sweep'}" if multirun else f"hydra.run.dir={tmp_path / 'rundir'}")
    return extra, "serve" if task == "serve" else "chat" if task == "chat" else "run"


def _parse_benchmark(where: str, args: list) -> None:
    """`python -m benchmarks <name> <flags>`: the benchmark's own parser takes the flags (`--parse-only`, in this
    process); what they run is the benchmark's code, which its dry form in tests/test_benchmarks.py runs."""
    import contextlib
    import io

    from benchmarks import benchmarks

    found = benchmarks()
    assert args[0] in found, f"{where}\nno benchmark {args[0]!r} (python -m benchmarks --list: {', '.join(found)})"
    err = io.StringIO()
    with pytest.raises(SystemExit) as done, contextlib.redirect_stderr(err):
        importlib.import_module(found[args[0]]).main([*args[1:], "--dry", "--parse-only"])
    assert done.value.code in (0, None), f"{where}\n{err.getvalue()}"


def _benchmark_argv(words: list) -> list:
    """`python -m benchmarks <name> ...` or `python benchmarks/<script> ...` with `--dry` where the benchmark
    takes it, else `--help`, placed before a `--` that hands the rest to launch.py."""
    if words[1] == "-m" and not (ROOT / "benchmarks" / "__main__.py").exists():
        pytest.skip("no `python -m benchmarks` entry point in this checkout")
    dry = words[1] == "-m" or re.search(r"--dry\b", subprocess.run(
        [sys.executable, words[1], "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout)
    args = words[1:]
    end = args.index("--") if "--" in args else len(args)
    return [sys.executable, *args[:end], "--dry" if dry else "--help", *args[end:]]


def _run_serve(argv, env, cwd, attempts: int = 3) -> tuple:
    """The server on a free port until /health answers, then SIGTERM; a port taken by another process between
    _free_port() and the server's bind (the other xdist worker's ranks) is given up for a new one."""
    import httpx

    port = _free_port()
    proc = subprocess.Popen([*argv, f"serve.port={port}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline, healthy = time.time() + TIMEOUT, False
    while time.time() < deadline and proc.poll() is None and not healthy:
        try:
            healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            time.sleep(0.5)
    if proc.poll() is None:  # as the docs say a server stops; its ranks follow
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    if not healthy and "address already in use" in err and attempts > 1:
        return _run_serve(argv, env, cwd, attempts - 1)
    assert healthy, f"the server never answered /health\n{out[-2000:]}{err[-3000:]}"
    return proc.returncode, out, err


# Marked slow (a minute or more of CPU on a loaded 2-core box): benchmarks, servers, lm-eval suites, sweeps, 2 ranks.
SLOW = re.compile(r"benchmarks|task=serve|evaluate\.tasks|\s-m\s|^torchrun|parallel=(dp2|fsdp2|tp2|pp2|ep2|cp2)\b")


@pytest.mark.parametrize("page, number, command", [
    pytest.param(*c, id=c[2][:110], marks=[pytest.mark.slow] if SLOW.search(c[2]) else []) for c in COMMANDS])
def test_doc_command_runs(page, number, command, artifacts, tmp_path, launch_py):
    where = f"{page}:{number}: {command}"
    expected = int(m.group(1)) if (m := re.search(r"#\s*exit (\d+)", command)) else 0
    words = shlex.split(_substitute(command, artifacts, tmp_path), comments=True)
    env = dict(os.environ)
    while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "python" and words[1] == "launch.py":
        argv, args = [sys.executable, str(ROOT / "launch.py"), *words[2:]], words[2:]
    elif words[0] == "speedllm":
        argv, args = [sys.executable, str(ROOT / "launch.py"), *words[1:]], words[1:]
    elif words[0] == "torchrun":
        script = words.index("launch.py")
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:script], str(ROOT / "launch.py"),
                *words[script + 1:]]
        args = words[script + 1:]
    else:  # a benchmark, run from the checkout
        if words[1:3] == ["-m", "benchmarks"] and len(words) == 4 and expected == 0:
            pytest.skip(f"tests/test_benchmarks.py runs `python -m benchmarks {words[3]} --dry` and checks its table")
        if words[1:3] == ["-m", "benchmarks"] and expected == 0 and "--" not in words:
            _parse_benchmark(where, words[3:])
            return
        argv = _benchmark_argv(words)
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        _check(where, proc.returncode, proc.stdout, proc.stderr, expected)
        return
    extra, mode = _cheap_launch(args, tmp_path) if expected == 0 else ([f"hydra.run.dir={tmp_path / 'rundir'}"], "run")
    argv = [*argv, *extra]
    cwd = tmp_path / "work"  # each command its own copy: a doc command may write where another reads
    shutil.copytree(artifacts / "work", cwd)
    if mode == "serve":
        _check(where, *_run_serve(argv, env, cwd), expected)
        return
    stdin = "/exit\n" if mode == "chat" else ""
    if argv[:2] == [sys.executable, str(ROOT / "launch.py")]:  # python launch.py / speedllm (as a user types it)
        proc = launch_py(argv[2:], cwd, env, input=stdin, timeout=TIMEOUT)
    else:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, input=stdin)
    _check(where, proc.returncode, proc.stdout, proc.stderr, expected)


def _check(where, code, out, err, expected):
    tail = f"\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-4000:]}"
    assert code == expected, f"{where}\nexit code {code}, documented {expected}{tail}"
    for bad in ("internal error", "Traceback"):
        assert bad not in out + err, f"{where}\nprinted {bad!r}{tail}"
