"""Fixtures shared by the test modules: the launcher as a user runs it, and tiny Qwen3 models in transformers form.

The config is composed with `speedllm.config.compose_config` (the library's own helper). Every test module carries
one group marker, registered in setup.cfg: `unit` (one process, behaviour and exact values), `numerics` (our
numbers against transformers or a single-process run) or `distributed` (several ranks); `slow` marks the long
end-to-end runs. `pytest -m "unit and not slow"` is the quick pass.

Under xdist (`pytest -n 2`, `--dist loadgroup` from setup.cfg) the tests that share a module-scoped fixture (one
multi-rank job, one server, one set of runs) form one group that a single worker runs, so the fixture runs once,
and the groups and the `slow` and `distributed` tests are handed out first (the longest work starts first).

Most of a small launch is process start-up (torch, Hydra and speedllm imports: seconds of CPU each). `launch` and
`launch_py` run `python launch.py ...` in a child forked from a process that has made those imports once; a multi-rank
test runs several layouts on one set of spawned ranks (`launch_ranks`) and its one-process references in the test's
own process (`launch_here`), each through the launcher's own steps.
"""

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.models.config import ModelConfig
from speedllm.paths import ASSETS, ROOT

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
# A 2-layer, 32-wide Qwen3 (GQA 4:2 heads of 16): small enough for any test, big enough to exercise every piece.
TINY_MODEL = dict(name="tiny", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rope_theta=5000.0)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    def first(item):  # slow before the rest, distributed before one-process
        return item.get_closest_marker("slow") is None, item.get_closest_marker("distributed") is None

    order = {}  # a group starts where its first test would, so it stays in one piece
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs.values()
        if any(d.scope == "module" for fixturedefs in defs for d in fixturedefs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            order[item.module] = min(order.get(item.module, first(item)), first(item))
    items.sort(key=lambda item: order.get(item.module, first(item)) if item.get_closest_marker("xdist_group")
               else first(item))


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws from torch's global generator seeded afresh, so its draws do not depend on which tests its
    xdist worker ran before it (a band met by most draws would otherwise fail now and then)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _seeded_module():
    """The same for a module's fixtures: an autouse fixture runs before the other fixtures of its scope."""
    torch.manual_seed(0)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under --dist loadgroup a worker names each grouped test `<id>@<group>`; a pytest that drops those names
    (pytest 9.2: pytest-xdist#1386) would spread every group over the workers and run its module fixture on each."""
    if node.config.getvalue("dist") == "loadgroup" and not any("@" in i for i in ids):
        pytest.exit("--dist loadgroup is not grouping tests with this pytest and pytest-xdist (pytest-xdist#1386): "
                    "pip install 'pytest>=8,<9.2' (the test extra's pin)", returncode=4)


def _float32(overrides) -> list:
    """`overrides` on a CPU in float32 unless they name a hardware.dtype: the exact-numerics tests hold fp32
    references, and hardware.dtype=auto picks bfloat16 on a CPU with AMX or AVX512-BF16 (speedllm.hardware).
    Another profile (hardware=a100, ...) keeps its own dtype."""
    profile = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("hardware=")), "cpu")
    told = any(o.startswith("hardware.dtype=") for o in overrides)
    return [*([] if told or profile not in ("cpu", "auto") else ["hardware.dtype=float32"]), *overrides]


def _launch_argv(run_dir, *overrides) -> list:
    """The command line (in float32 unless told: _float32)."""
    return [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *_float32(overrides)]


# A process that has imported what every `python launch.py` imports (torch, Hydra, speedllm's launcher) and forks a
# child per launch: the child takes the launch's argv, working directory, environment and stdin/stdout/stderr files,
# then runs launch.py as `python launch.py ...` would (runpy, __name__ == "__main__", a normal interpreter exit).
# Only the interpreter start-up and those imports are shared; a launch with another environment than the one the
# process started with gets a fresh interpreter.
_FORK_SERVER = """
import json, os, runpy, sys
launch_py = sys.argv[1]
sys.path[0] = os.path.dirname(launch_py)  # as `python launch.py` sets it
import speedllm.cli, speedllm.launcher  # noqa: E401,F401
import torch._dynamo  # noqa: F401  (the first nn.init on the meta device imports it: ~0.5 s of every launch)
job = None
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
    job = None
if job is None:
    sys.exit(0)
os.chdir(job["cwd"])
os.environ.clear()
os.environ.update(job["env"])
for fd, name in enumerate(("stdin", "stdout", "stderr")):
    f = os.open(job[name], os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(f, fd)
    os.close(f)
sys.stdin = sys.__stdin__ = open(0, closefd=False)
sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
sys.argv = [launch_py, *job["argv"]]
runpy.run_path(launch_py, run_name="__main__")
"""


def _environment(env) -> dict:
    """The environment a launch sees, but for the name of the running test (pytest's, changing every test)."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


class _ForkServer:
    def __init__(self):
        self.env = _environment(_SESSION_ENV)
        self.files = Path(tempfile.mkdtemp(prefix="launch_io_"))
        atexit.register(shutil.rmtree, self.files, True)
        # unbuffered: a line is read byte by byte, so select() sees the exit code the moment it is written
        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, str(ROOT / "launch.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=self.env)

    def run(self, args, cwd, env, input, timeout) -> subprocess.CompletedProcess:
        io = {name: str(self.files / name) for name in ("stdin", "stdout", "stderr")}
        Path(io["stdin"]).write_text(input)
        job = {"argv": list(map(str, args)), "cwd": str(cwd), "env": env, **io}
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        pid = int(self.proc.stdout.readline())
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = int(self.proc.stdout.readline())
        out, err = Path(io["stdout"]).read_text(), Path(io["stderr"]).read_text()
        if not ready:
            raise subprocess.TimeoutExpired(args, timeout, out, err)
        return subprocess.CompletedProcess(args, code, out, err)


_fork_server = []  # started at the first launch, with the session's environment
_SESSION_ENV = {}


def pytest_collection_finish(session):
    """The session's environment: as the test modules' imports left it (test_harness sets a variable)."""
    _SESSION_ENV.update(os.environ)


def _run_launch_py(args, cwd, env=None, input="", timeout=300) -> subprocess.CompletedProcess:
    """`python launch.py <args>` from `cwd` with `env` (default: this process' environment), `input` on stdin:
    its exit code, stdout and stderr (subprocess.run's result). Runs in a child of the fork server unless `env`
    differs from the session's (a test that sets a variable gets a fresh interpreter)."""
    env = dict(os.environ if env is None else env)
    if _environment(env) != _environment(_SESSION_ENV):
        return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=cwd, env=env, input=input,
                              capture_output=True, text=True, timeout=timeout)
    if not _fork_server or _fork_server[0].proc.poll() is not None:
        _fork_server[:] = [_ForkServer()]
    return _fork_server[0].run(args, cwd, env, input, timeout)


def _launch(run_dir, *overrides, cwd=None, timeout=300) -> tuple:
    run_dir = Path(run_dir)
    cwd = Path(cwd) if cwd is not None else run_dir
    cwd.mkdir(parents=True, exist_ok=True)
    proc = _run_launch_py([f"hydra.run.dir={run_dir}", *_float32(overrides)], cwd, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def launch_py():
    """`launch_py(args, cwd, env=None, input="", timeout=300) -> subprocess.CompletedProcess`: `python launch.py
    <args>` run as a user would (see _run_launch_py)."""
    return _run_launch_py


@pytest.fixture(scope="session")
def launch():
    """`launch(run_dir, *overrides, cwd=run_dir, timeout=300) -> (exit code, stdout, stderr)`: `python launch.py
    hydra.run.dir=<run_dir> <overrides>` run as a user would, from `cwd` (in float32 unless told: _float32)."""
    return _launch


@pytest.fixture(scope="session")
def launch_argv():
    """`launch_argv(run_dir, *overrides)`: the same command line, for a test that starts the process itself."""
    return _launch_argv


def _launch_here(run_dir, *overrides) -> None:
    """What `python launch.py hydra.run.dir=<run_dir> <overrides>` does after Hydra for a one-process run, in this
    process (speedllm.launcher.launch on the composed config: resolve, validate, freeze, run the task)."""
    from speedllm.config import compose_config
    from speedllm.launcher import launch

    status = launch(compose_config(f"run_dir={run_dir}", "logging.progress_bar=false", *_float32(overrides)))
    assert status == 0, f"{run_dir}: exit status {status} (its output is in the captured stdout and stderr)"


def _rank_runs(rank: int, world_size: int, port: int, jobs: list) -> None:
    """One rank of `launch_ranks`: each job as launch.py's launcher and its spawned worker run it (resolve,
    validate and freeze on every rank, rank 0 writes the frozen config, each rank reads it back, builds its runtime
    and runs the task with its output copied into launch.log), all jobs on one process group."""
    import torch.distributed as dist

    from speedllm.config import compose_config
    from speedllm.config.resolve import resolve
    from speedllm.config.validate import validate
    from speedllm.console import console_log
    from speedllm.launcher import FROZEN_NAME, run_task, write_frozen
    from speedllm.runtime import init_runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    for run_dir, overrides in jobs:
        cfg = compose_config(f"run_dir={run_dir}", "logging.progress_bar=false", *_float32(overrides))
        world, nproc = resolve(cfg)
        validate(cfg, world, nproc)
        assert world == nproc == world_size, (run_dir, world, world_size)
        OmegaConf.resolve(cfg)
        if rank == 0:
            write_frozen(cfg, Path(run_dir))
        dist.barrier()
        cfg = OmegaConf.load(Path(run_dir) / FROZEN_NAME)
        with console_log(Path(run_dir)):  # the ranks' output in <run_dir>/launch.log, as launched
            run_task(cfg, init_runtime(cfg))
        dist.barrier()
    dist.destroy_process_group()


def _launch_ranks(world_size: int, jobs: dict) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for run_dir in jobs:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.spawn(_rank_runs, args=(world_size, port, list(jobs.items())), nprocs=world_size)


@pytest.fixture(scope="session")
def launch_here():
    """`launch_here(run_dir, *overrides)`: a one-process run of launch.py's overrides in this process (no
    interpreter start-up); fails with the run's log unless it exits 0."""
    return _launch_here


@pytest.fixture(scope="session")
def launch_ranks():
    """`launch_ranks(world_size, {run_dir: overrides})`: the runs of a world_size-rank job, one after the other, on
    world_size spawned processes that start once and keep one process group (several layouts share one start-up);
    each run goes through the launcher's steps (see _rank_runs). A failing rank fails the call with its traceback."""
    return _launch_ranks


def _tiny_model_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {**TINY_MODEL, **overrides})


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """`tiny_model_cfg(**overrides)`: the ModelConfig of TINY_MODEL with `overrides` (any ModelConfig field)."""
    return _tiny_model_cfg


def _tiny_hf(cfg, seed):
    """transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM when cfg has experts) for `cfg`, initialized under `seed`."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from speedllm.models.hf_adapter import hf_config

    torch.manual_seed(seed)
    return (Qwen3MoeForCausalLM if cfg.num_experts else Qwen3ForCausalLM)(hf_config(cfg)).eval()


def _hf_pair(seed=0, ops="reference", **overrides):
    from speedllm.models.hf_adapter import from_hf_state_dict
    from speedllm.models.qwen3 import Qwen3

    cfg = _tiny_model_cfg(**overrides)
    hf = _tiny_hf(cfg, seed)
    ours = Qwen3(cfg, ops=ops).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return cfg, hf, ours


@pytest.fixture(scope="session")
def hf_pair():
    """`hf_pair(seed=0, ops="reference", **overrides) -> (cfg, transformers model, our Qwen3)`: a random tiny
    transformers model and our model (on op set `ops`) carrying the same weights, both in eval mode."""
    return _hf_pair


def _save_tiny_hf(path, seed=0, tokenizer=True, max_shard_size="5GB", **overrides):
    hf = _tiny_hf(_tiny_model_cfg(**overrides), seed)
    path = Path(path)
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        for file in DEMO_TOKENIZER.iterdir():
            shutil.copy(file, path / file.name)
    return hf


@pytest.fixture(scope="session")
def save_tiny_hf():
    """`save_tiny_hf(path, seed=0, tokenizer=True, max_shard_size="5GB", **overrides) -> transformers model`: a
    randomly initialized tiny Qwen3 (MoE when `num_experts` is set) saved by transformers' save_pretrained into
    `path`, with the demo tokenizer's files beside it (the model's vocab_size must then cover its 8192 ids)."""
    return _save_tiny_hf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """`(path, transformers model, demo tokenizer)`: a random tiny Qwen3 (seed 9, tied, the demo tokenizer's
    vocabulary) saved by transformers with the demo tokenizer's files beside it."""
    from speedllm.data.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("hf")
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    hf = _save_tiny_hf(path, seed=9, vocab_size=len(tok), tie_word_embeddings=True)
    return path, hf, tok


class LocalS3:
    """moto's S3 server on a free port of localhost; its objects live in this process, so they outlast a stop()."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def fs(self):
        """An s3fs filesystem on this server, with no cached listings."""
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.invalidate_cache()
        return fs

    def bucket(self, name: str) -> str:
        self.fs().mkdir(name)
        return name


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server on localhost for the session (LocalS3). Every process started from here reaches
    it the way a user's job reaches theirs: credentials and endpoint in the environment (AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL); AWS_MAX_ATTEMPTS=1 leaves the retrying to SpeedLLM's own."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}.items():
            env.setenv(key, value)
        server = LocalS3()
        env.setenv("AWS_ENDPOINT_URL", server.endpoint)
        yield server
        server.stop()
