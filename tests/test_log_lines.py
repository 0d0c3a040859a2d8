"""A run whose console is not a terminal (`python launch.py > log.txt`, CI, SLURM) logs lines, not bar frames."""

import io
import sys

import pytest

from speedllm.train.metrics import MetricsLogger

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_bar_only_on_a_terminal_and_one_line_per_logged_step(tmp_path, monkeypatch, terminal):
    class Console(io.StringIO):
        def isatty(self):
            return terminal

    console = Console()
    monkeypatch.setattr(sys, "stderr", console)
    monkeypatch.setattr(sys, "stdout", console)
    logger = MetricsLogger(str(tmp_path), total_steps=50, start_step=0, enabled=True, tensorboard=False)
    for step in range(1, 51):
        logger.log(step, {"loss": 2.0, "tokens_per_s": 1000.0})
        logger.advance(step)
    logger.close()
    text = console.getvalue()
    assert (logger.bar is not None) == terminal
    if not terminal:  # 50 steps: 50 lines, each with its figures, and no carriage-return frame
        assert "\r" not in text and len(text.splitlines()) == 50
        assert text.splitlines()[-1] == "[train] step 50 loss=2 tokens_per_s=1000"
