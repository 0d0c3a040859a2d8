"""Hostile inputs to storage URLs, grpo, distill and the hardware probe, met as a user meets them: no output on top
of an input, no credential printed or saved, no silently wrong run, file:// URLs as plain paths, what the first save
would hit refused before step 1, and one line where there was an internal error.

Where the command line itself matters (Hydra's record of it, a process' exit code, its environment) the test runs
launch.py; the other cases run launch() in this process on the composed config (tests/test_bad_inputs.py's way)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from conftest import DEMO_TOKENIZER
from test_bad_inputs import SMALL, run_inprocess, tree_hash
from test_grpo_task import RL
from test_train_loop import TINY, metrics

from speedllm.paths import ROOT

pytestmark = pytest.mark.unit

SMALL_RL = ["rl.prompts_per_step=2", "rl.group_size=2"]


def refused(status, out, err, *names) -> str:
    """launch()'s result: exit status 2 and one line naming `names` (the last line of stderr)."""
    assert status == 2 and "Traceback" not in out + err and "internal error" not in out + err, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(name in last for name in names), (names, last)
    return last


def one_line_error(code, out, err, *names):
    """launch.py's result: exit code 2, and one line on stderr naming `names`."""
    assert code == 2 and "Traceback" not in out + err and "internal error" not in out + err, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(name in lines[0] for name in names), (names, lines[0])
    return lines[0]


def env_with(**changes) -> dict:
    env = {**os.environ, **changes}
    return {k: v for k, v in env.items() if v is not None}


def launch_env(run_dir, *overrides, env, cwd=None, timeout=300):
    """launch.py in a fresh interpreter with `env` (in float32 on the CPU); (code, stdout, stderr)."""
    from conftest import _launch_argv

    cwd = Path(cwd or run_dir)
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(_launch_argv(run_dir, *overrides), capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------ inputs and outputs

def test_distill_onto_its_teacher_is_refused_and_the_teacher_kept(tmp_path, capsys, save_tiny_hf):
    """checkpoint.dir = the teacher's directory, by its path and through a symbolic link: one line naming both
    keys, exit 2, the teacher byte for byte as before."""
    teacher = tmp_path / "teacher"
    save_tiny_hf(teacher, vocab_size=8192)
    link = tmp_path / "link"
    link.symlink_to(teacher)
    before = tree_hash(teacher)
    distill = ["task=distill", "hardware=cpu", "data=sft_demo", *SMALL, f"distill.teacher={teacher}"]
    for where in (teacher, link):
        refused(*run_inprocess(tmp_path, capsys, *distill, f"checkpoint.dir={where}"), f"checkpoint.dir={where} "
                f"would write over the input distill.teacher={teacher}; choose another checkpoint.dir")
    assert tree_hash(teacher) == before and not (tmp_path / "run").exists()


def test_checkpoint_dir_may_hold_what_it_resumes_but_not_the_data(tmp_path, capsys):
    """checkpoint.dir holding the training data (data.path's .bin/.idx) is refused; holding checkpoint.load (a
    resume) is not."""
    from speedllm.data.preprocess import preprocess

    prefix = tmp_path / "ck" / "corpus"
    prefix.parent.mkdir()
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"To be or not to be, {i} times."}) + "\n" for i in range(64)))
    preprocess(str(docs), str(prefix), str(DEMO_TOKENIZER), workers=1, progress=False)
    refused(*run_inprocess(tmp_path, capsys, *TINY, "train.steps=1", f"data.path={prefix}",
                           f"checkpoint.dir={tmp_path / 'ck'}"), f"checkpoint.dir={tmp_path / 'ck'}",
            f"the input data.path={prefix}.bin")


# ------------------------------------------------------------------------------------------------ grpo

def test_grpo_settings_that_gave_silently_wrong_runs_are_refused(tmp_path, capsys):
    """Context parallelism (the gradient counted once per cp rank) and non-finite coefficients (a NaN loss every
    step) are refused before launch, naming the key."""
    cases = [(["parallel=cp2"], "parallel.cp=2"), (["rl.kl_coef=inf"], "rl.kl_coef=inf must be >= 0"),
             (["rl.overlong_buffer=2", "rl.overlong_penalty=nan"], "rl.overlong_penalty=nan must be >= 0"),
             (["rl.clip_high=-inf"], "rl.clip_high=-inf")]
    for overrides, message in cases:
        refused(*run_inprocess(tmp_path, capsys, *TINY, *RL, *overrides), message)
    assert not (tmp_path / "run").exists()


def test_grpo_stops_after_max_bad_steps_without_saving(tmp_path, capsys):
    """An LR that blows the weights up: every step after the first is non-finite; train.max_bad_steps=2 in a row
    stop the run in one line, and the bad state is not saved."""
    refused(*run_inprocess(tmp_path, capsys, *TINY, *RL, *SMALL_RL, "optim.lr=1e30", "optim.weight_decay=0",
                           "train.grad_clip=0", "train.steps=6", "train.max_bad_steps=2", "checkpoint.every=1"),
            "train: 2 consecutive steps had a non-finite loss or gradient", "train.max_bad_steps=2")
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    records = metrics(tmp_path / "run")
    bad = [r["step"] for r in records if r["skipped_steps"] > 0]
    assert bad and saved == [f"step_{s:08d}" for s in range(1, bad[0])], (saved, bad)


def exits(prompts, completions, **columns):
    sys.exit(0)


def as_generator(prompts, completions, **columns):
    return (1.0 for _ in completions)


def empties(prompts, completions, **columns):
    n = len(completions)
    prompts.clear()
    completions.clear()
    for v in columns.values():
        v.clear()
    return [0.5] * n


def counts(prompts, completions, completion_ids, **columns):
    return [float(len(completions) + len(prompts) + len(completion_ids))] * len(completions)


def test_reward_functions_cannot_end_or_corrupt_the_run(tmp_path, capsys):
    """A reward calling sys.exit(0): exit status 2 and one line naming it (it ended the run with 0, nothing saved).
    A generator is read to its end; a reward that empties the lists it was given leaves the next one its own."""
    refused(*run_inprocess(tmp_path, capsys, *TINY, *RL, *SMALL_RL, "train.steps=1",
                           "rl.rewards=[{_target_: test_hostile_io.exits}]"), "rl.rewards: exits called sys.exit(0)")
    rewards = ("rl.rewards=[{_target_: test_hostile_io.as_generator}, {_target_: test_hostile_io.empties}, "
               "{_target_: test_hostile_io.counts}]")
    status, out, err = run_inprocess(tmp_path, capsys, *TINY, *RL, *SMALL_RL, "train.steps=1", rewards)
    assert status == 0, out + err
    (record,) = metrics(tmp_path / "run")
    rows = 2 * 2  # rl.prompts_per_step x rl.group_size
    assert record["rl/reward/as_generator"] == 1.0 and record["rl/reward/empties"] == 0.5
    assert record["rl/reward/counts"] == 3 * rows


def test_chat_prompts_without_a_chat_template_are_one_line(tmp_path, capsys):
    plain = tmp_path / "tok"
    shutil.copytree(DEMO_TOKENIZER, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert not (plain / "chat_template.jinja").exists()
    refused(*run_inprocess(tmp_path, capsys, *TINY, *RL, f"data.tokenizer={plain}"), "prompts.jsonl:1: chat "
            "messages need the tokenizer's chat template")


# -------------------------------------------------------------------------------------------- file://

def test_file_urls_train_save_and_resume_like_the_plain_path(tmp_path, capsys, monkeypatch):
    """checkpoint.dir=file:///...: trains, saves there, and resumes from it with the losses of the uninterrupted
    run bit for bit; file: with one slash and a relative file:// are refused before launch."""
    run = [*TINY, "train.steps=2", "checkpoint.every=1"]
    status, out, err = run_inprocess(tmp_path / "straight", capsys, *run)
    assert status == 0, err
    url = f"file://{tmp_path / 'ck'}"
    status, out, err = run_inprocess(tmp_path / "url", capsys, *run, f"checkpoint.dir={url}", "train.stop_after=1")
    assert status == 0, err
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step_00000001"
    status, out, err = run_inprocess(tmp_path / "url", capsys, *run, f"checkpoint.dir={url}", "checkpoint.load=auto")
    assert status == 0 and f"resumed from {tmp_path / 'ck'}/step_00000001 at step 1" in out, out + err
    assert [(r["step"], r["loss"]) for r in metrics(tmp_path / "url" / "run")] == \
        [(r["step"], r["loss"]) for r in metrics(tmp_path / "straight" / "run")]
    monkeypatch.chdir(tmp_path / "url")
    for bad, fix in ((f"file:{tmp_path}/x", f"give checkpoint.dir=file://{tmp_path}/x"),
                     ("file://relative/x", "file:// needs an absolute path")):
        refused(*run_inprocess(tmp_path, capsys, *run, f"checkpoint.dir={bad}"), fix)
    assert not (tmp_path / "run").exists() and not list((tmp_path / "url").glob("file*"))


# ------------------------------------------------------------------------------ refused before step 1

@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/sys/fs", os.W_OK), reason="needs root, where os.access "
                    "says a read-only sysfs folder is writable")
def test_a_read_only_checkpoint_dir_is_refused_before_step_1_as_root(tmp_path, capsys):
    """As root os.access says /sys/fs is writable; no file can be made there. Refused before launch."""
    status, out, err = run_inprocess(tmp_path, capsys, *TINY, "train.steps=1", "checkpoint.dir=/sys/fs/speedllm-run")
    refused(status, out, err, "checkpoint.dir=/sys/fs/speedllm-run: a file cannot be written in /sys/fs")
    assert "step 1" not in out and not (tmp_path / "run").exists()


def test_a_tarpit_s3_endpoint_fails_within_30_seconds_naming_the_url(tmp_path):
    """An S3 endpoint that accepts connections and never answers (a listening socket nobody reads): the
    checkpoint.load check gives up within seconds per attempt, in one line naming the URL."""
    with socket.socket() as tarpit:
        tarpit.bind(("127.0.0.1", 0))
        tarpit.listen(64)
        env = env_with(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                       AWS_ENDPOINT_URL=f"http://127.0.0.1:{tarpit.getsockname()[1]}", AWS_MAX_ATTEMPTS=None)
        start = time.monotonic()
        code, out, err = launch_env(tmp_path / "run", *TINY, "checkpoint.load=s3://bucket/run", env=env, timeout=120)
        took = time.monotonic() - start
    one_line_error(code, out, err, "checkpoint.load=s3://bucket/run: the storage refused or could not be reached",
                   "ReadTimeoutError")
    assert took < 30, took


# -------------------------------------------------------------------------------------- caches, env vars

@pytest.mark.parametrize("corrupt", [[], "fast", {"float32": 0, "bfloat16": 0}, {"float32": "many"}])
def test_a_corrupt_probe_cache_is_measured_again(corrupt, tmp_path, monkeypatch, capsys):
    from speedllm.hardware import PROBED, cpu_probe, probe_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet box: the measurement is cached
    path = probe_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(corrupt))
    rates = cpu_probe()
    assert set(rates) == set(PROBED) and all(v > 0 for v in rates.values())
    assert json.loads(path.read_text()) == rates  # the new measurement replaced the corrupt one
    assert f"note: {path} holds no valid measurement" in capsys.readouterr().out


def test_a_zero_probe_cache_is_measured_again_by_a_run(tmp_path, monkeypatch, capsys):
    """hardware.dtype=auto on a cache of zeros (a division by zero before): measured again, the run goes on."""
    from speedllm.hardware import probe_file

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = probe_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"float32": 0, "bfloat16": 0}))
    status, out, err = run_inprocess(tmp_path, capsys, "task=doctor", "hardware.dtype=auto")
    assert status == 0 and f"note: {path} holds no valid measurement" in out, out + err
    assert all(v > 0 for v in json.loads(path.read_text()).values())


def test_empty_cache_variables_write_nothing_into_the_working_directory(tmp_path, monkeypatch, capsys):
    """SPEEDLLM_CACHE= and XDG_CACHE_HOME= (set, empty) count as unset: the tokenized demo corpus and the probe
    cache go under $HOME/.cache, nothing into the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    for name, value in (("SPEEDLLM_CACHE", ""), ("XDG_CACHE_HOME", ""), ("HOME", str(home))):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(work)
    status, out, err = run_inprocess(tmp_path, capsys, *TINY, "train.steps=1")
    assert status == 0, out + err
    assert list(work.iterdir()) == []
    assert list((home / ".cache" / "speedllm" / "probe").glob("gemm_*.json"))
    assert list((home / ".cache" / "speedllm" / "demo").iterdir())


# ------------------------------------------------------------------------ internal errors, now one line

def test_former_internal_errors_are_one_line(tmp_path, capsys, monkeypatch, save_tiny_hf):
    """A teacher whose tokenizer.json is truncated; distill.teacher_quant=int8_wo without torchao (as Python
    sees a package that is not there); checkpoint.dir=ftp:// on a dead host."""
    teacher = tmp_path / "teacher"
    save_tiny_hf(teacher, vocab_size=8192)
    text = (teacher / "tokenizer.json").read_text()
    (teacher / "tokenizer.json").write_text(text[:len(text) // 2])
    distill = ["task=distill", "hardware=cpu", "data=sft_demo", *SMALL]
    status, out, err = run_inprocess(tmp_path, capsys, *distill, f"distill.teacher={teacher}")
    assert status == 2 and "internal error" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: distill.teacher: {teacher / 'tokenizer.json'} cannot be "
                                                   "read")
    (teacher / "tokenizer.json").write_text(text)
    monkeypatch.setitem(sys.modules, "torchao", None)
    status, out, err = run_inprocess(tmp_path, capsys, *distill, f"distill.teacher={teacher}",
                                     "distill.teacher_quant=int8_wo")
    assert status == 2 and "distill.teacher_quant=int8_wo needs torchao, which is not installed" in err, err
    status, out, err = run_inprocess(tmp_path, capsys, *TINY, "checkpoint.dir=ftp://127.0.0.1:9/run")
    assert status == 2 and "error: checkpoint.dir=ftp://127.0.0.1:9/run: the storage could not be reached" in err, err


# ------------------------------------------------------------------------------------------- secrets

SECRETS = ("AKIDLEAKCHECK77", "Sup3rSecretValue", "webuser", "WebPassw0rdX", "ftpuser", "FtpSecret99",
           "TOKENONLYUSER88")


def test_credentials_in_urls_are_never_printed_logged_or_saved(tmp_path, s3, capsys, monkeypatch):
    """Four URL forms with credentials: an s3:// checkpoint.dir with key and secret trains and saves (the secret
    reaches s3fs, not config.yaml); https://, ftp:// and an s3:// user alone are refused in one line. No credential
    is in stdout, stderr or any file the runs wrote (Hydra's record of the command line included, locally or in
    the bucket); the masked form is."""
    from speedllm.storage import CREDENTIALS_ENV

    bucket = s3.bucket("secret")
    run_dir = tmp_path / "accepted"
    code, out, err = launch_env(run_dir, *TINY, "train.steps=1",
                                f"checkpoint.dir=s3://AKIDLEAKCHECK77:Sup3rSecretValue@{bucket}/run", env=os.environ)
    assert code == 0 and s3.fs().exists(f"{bucket}/run/latest"), out + err
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"launch.log", "config.yaml", "metrics.jsonl", "overrides.yaml"} <= {p.name for p in written}
    assert f"dir: s3://***@{bucket}/run" in (run_dir / "config.yaml").read_text()
    assert not [p for p in s3.fs().find(bucket) if ".speedllm-probe" in p]  # the write probe was deleted
    texts = [out, err, *(p.read_text(errors="replace") for p in written),
             *(s3.fs().cat(p).decode(errors="replace") for p in s3.fs().find(f"{bucket}/run"))]
    monkeypatch.setenv(CREDENTIALS_ENV, "")  # the refused runs below run here: their credentials leave with the test
    cases = [
        (["task=convert", "convert.to=dcp", "model=hf", f"convert.out={tmp_path / 'out'}",
          "checkpoint.load_hf=https://webuser:WebPassw0rdX@127.0.0.1:9/model"],
         "checkpoint.load_hf=https://***@127.0.0.1:9/model"),
        (["checkpoint.dir=ftp://ftpuser:FtpSecret99@127.0.0.1:9/run"], "checkpoint.dir=ftp://***@127.0.0.1:9/run"),
        (["task=sft", "data=sft_demo", f"data.input=s3://TOKENONLYUSER88@{bucket}/sft.jsonl"],
         f"data.input=s3://***@{bucket}/sft.jsonl"),
    ]
    for overrides, shown in cases:
        status, out, err = run_inprocess(tmp_path, capsys, *TINY, "train.steps=1", *overrides)
        refused(status, out, err, shown)
        texts += [out, err]
    assert not (tmp_path / "run").exists()  # refused: the run directory went with it
    for secret in SECRETS:
        assert not any(secret in text for text in texts), secret


# ------------------------------------------------------------------------------------ remote inputs

def test_grpo_prompts_sft_records_and_a_distill_teacher_from_s3(tmp_path, s3, capsys, save_tiny_hf):
    """data.input=s3://... for grpo and sft, distill.teacher=s3://...: each run trains a step on the local copy in
    data.cache_dir, byte for byte the object."""
    bucket = s3.bucket("inputs")
    fs = s3.fs()
    prompts = ROOT / "speedllm" / "assets" / "rl_demo" / "prompts.jsonl"
    sft = ROOT / "speedllm" / "assets" / "sft_demo" / "messages.jsonl"
    fs.put_file(str(prompts), f"{bucket}/prompts.jsonl")
    fs.put_file(str(sft), f"{bucket}/sft.jsonl")
    save_tiny_hf(tmp_path / "teacher", vocab_size=8192)
    fs.put(str(tmp_path / "teacher") + "/", f"{bucket}/teacher/", recursive=True)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    runs = {
        "grpo": ([*TINY, *RL, *SMALL_RL, "train.steps=1", f"data.input=s3://{bucket}/prompts.jsonl"], "data.input", prompts),
        "sft": ([*TINY, "task=sft", "data=sft_demo", "train.steps=1", f"data.input=s3://{bucket}/sft.jsonl"],
                "data.input", sft),
        "distill": ([*TINY, "task=distill", "data=sft_demo", "data.packing=false", "train.seq_len=64",
                     "train.steps=1", f"distill.teacher=s3://{bucket}/teacher"], "distill.teacher",
                    tmp_path / "teacher" / "config.json"),
    }
    for name, (overrides, key, original) in runs.items():
        status, out, err = run_inprocess(tmp_path / name, capsys, *overrides, cache)
        assert status == 0, (name, out + err)
        assert [r["step"] for r in metrics(tmp_path / name / "run")] == [1], name
        value = OmegaConf.select(OmegaConf.load(tmp_path / name / "run" / "config.yaml"), key)
        local = Path(value if isinstance(value, str) else value[0])
        local = local / original.name if local.is_dir() else local
        assert str(local).startswith(str(tmp_path / "cache")) and local.read_bytes() == original.read_bytes(), name
