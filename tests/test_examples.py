"""The examples run: a shortened examples/train_copy_task.py learns (its loss falls)."""
import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_copy_task_loss_falls(capsys):
    example = _load("train_copy_task")
    result = example.train(steps=30, batch_size=32, eval_size=20)
    losses = result["losses"]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert 0.0 <= result["accuracy"] <= 1.0
    assert "30/30" in capsys.readouterr().out  # the progress bar reached the end
