"""What a run shows and keeps: the console copied into <run_dir>/launch.log, one line per failure (never a
traceback on the console), and no run directory left behind by a run that kept nothing.
"""

import contextlib
import io
import sys
import traceback
from pathlib import Path
from typing import Callable

from speedllm.errors import UserError, one_line
from speedllm.storage import scrub

LOG_NAME = "launch.log"
# Files a run directory holds before the task writes anything: Hydra's record of the job, the log, the frozen config.
_BOOKKEEPING = {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", LOG_NAME, "config.yaml"}


class _Tee(io.TextIOBase):
    """A text stream that writes to the console stream and to the log; progress-bar redraws stay off the log."""

    def __init__(self, console, log):
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        shown = scrub(text)  # no credential of a URL is ever shown or logged
        self.console.write(shown)
        if "\r" not in shown or "\n" in shown:
            self.log.write(shown.replace("\r", ""))
            self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.console.flush()

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self):
        return self.console.encoding


@contextlib.contextmanager
def console_log(run_dir: Path):
    """Copy stdout and stderr into <run_dir>/launch.log (appended: ranks of one job share it); yields the log."""
    if isinstance(sys.stdout, _Tee):  # a torchrun rank: launch() already copies the console
        yield sys.stdout.log
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOG_NAME, "a", encoding="utf-8") as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield log
        finally:
            sys.stdout, sys.stderr = out, err


def guarded(fn: Callable[[], None], log, run_dir: Path, prefix: str = "") -> int:
    """Run fn; return its exit status. A user error is one line (status 2); anything unexpected is one line on
    the console and its full traceback in the log (status 1)."""
    try:
        fn()
    except UserError as e:
        print(f"error: {prefix}{e}", file=sys.stderr)
        return 2
    except Exception as e:
        cause = _user_error_inside(e)  # e.g. raised in a config resolver, which OmegaConf wraps
        if cause is None:
            return _internal_error(e, log, run_dir, prefix)
        print(f"error: {prefix}{cause}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        print(f"error: {prefix}interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # noqa: BLE001 - the catch-all: DCP's CheckpointException is a BaseException
        return _internal_error(e, log, run_dir, prefix)
    return 0


def _user_error_inside(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, UserError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _internal_error(e: BaseException, log, run_dir: Path, prefix: str) -> int:
    log.write(scrub(traceback.format_exc()))
    log.flush()
    print(f"internal error: {prefix}{one_line(e, 300)}; full traceback in {run_dir / LOG_NAME}; please report it",
          file=sys.stderr)
    return 1


def scrub_run_files(run_dir: Path) -> None:
    """Hydra's record of the command line (<run_dir>/.hydra) with the credentials of its URLs masked."""
    for file in run_dir.glob(".hydra/*.yaml"):
        text = file.read_text()
        if scrub(text) != text:
            file.write_text(scrub(text))


def discard_run_dir(run_dir: Path) -> None:
    """Remove a run directory that holds nothing but bookkeeping (a run that kept nothing); anything else stays."""
    if not run_dir.is_dir():
        return
    files = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if not p.is_dir()}
    dirs = [p for p in run_dir.rglob("*") if p.is_dir()]
    if not files <= _BOOKKEEPING or any(d.name != ".hydra" for d in dirs):
        return
    for name in files:
        (run_dir / name).unlink()
    for d in dirs:
        d.rmdir()
    run_dir.rmdir()
