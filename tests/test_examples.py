"""Every example runs as its docstring says, from the repository root, with nothing else set up.

Each is a few ranks under torchrun or spawned, so they run in the slow suite (``make test-slow``);
their code paths are the default suite's (tests/test_cli.py, tests/runtime/, tests/weights/), and
tests/test_docs.py checks there that the README shows examples/train_hf.py as it is.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if "__main__" in p.read_text() or p.name == "train_hf.py")


def run_line(path: Path) -> str:
    """The first command of the example's docstring that runs it."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    for line in doc.splitlines():
        command = line.split("#")[0].strip()
        if re.match(r"(python|torchrun)\b", command) and (f"examples.{path.stem}" in command
                                                         or f"examples/{path.stem}.py" in command):
            return command
    raise AssertionError(f"{path.name} says nowhere how to run it")


def run(command: str, timeout_s: float) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow  # its steps run in the default suite: tests/weights/test_loading.py (meta, load, train)
def test_the_readme_example_runs_as_written():
    proc = run(run_line(ROOT / "examples" / "train_hf.py"), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", proc.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], proc.stdout[-2000:]  # it trains
    assert "colwise" in proc.stdout and "rowwise" in proc.stdout  # the plan it prints shards the blocks


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.name != "train_hf.py"], ids=lambda p: p.name)
def test_each_example_runs_as_written(path):
    proc = run(run_line(path), 900)
    assert proc.returncode == 0, f"{run_line(path)}\n{proc.stderr[-3000:]}"


def _fails_on_rank_zero(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("rank zero fails before its broadcast")
    dist.broadcast(torch.zeros(1), src=0)  # waits for rank 0, which never comes


def test_a_rank_that_fails_ends_the_ranks_waiting_for_it():
    """run_ranks reports the failed rank's error instead of hanging on the ranks that wait for it in
    a collective (gloo's wait would last its 30-minute timeout)."""
    from examples.ranks import run_ranks

    with pytest.raises(AssertionError, match="rank 0 failed(.|\n)*rank zero fails before its broadcast"):
        run_ranks(_fails_on_rank_zero, 2)
