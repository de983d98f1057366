"""The training step is written once (zeroshard/trainer/step.py); nothing else in the library or the benches
runs its own forward/backward/optimizer-step loop.

Every ``.backward(...)`` call and every ``.step(...)`` call on an optimizer-like receiver in
zeroshard/ and bench/ must sit in a function named below, with the reason it is not a training step.
A new tool that needs a step calls ``zeroshard.trainer.step`` (with hooks if it must look inside) instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("zeroshard", "bench")

ALLOWED = {
    ("zeroshard/trainer/step.py", "accumulate_gradients"): "the step's micro-steps",
    ("zeroshard/trainer/step.py", "optimizer_step"): "the step's optimizer step",
    ("zeroshard/trainer/step.py", "pipeline_step"): "a pipeline run's step: torch's schedule runs the micro-steps",
    ("zeroshard/trainer/step.py", "plain_step"): "the plain PyTorch step the benchmarks' peers take",
    ("zeroshard/trainer/train.py", "reference_train"): "the single-process plain-PyTorch reference",
    ("zeroshard/trainer/train.py", "reference_backward"): "the reference's backward of a global batch",
    ("zeroshard/runtime/scaler.py", "step"): "ShardedGradScaler.step, torch's GradScaler API",
    ("zeroshard/tools/planner/optim_probe.py", "_one_step"): "one optimizer step on synthetic tensors, no model",
    ("zeroshard/tools/planner/owner_state.py", "_step_state"): "one optimizer step on one param's shape, no model",
    ("bench/context_parallel.py", "_saved_bytes"): "one forward/backward's saved activations per cp degree, no step",
    ("zeroshard/observing/profile/activations.py", "activation_bytes"): "one forward/backward's activations, no step",
    ("bench/activation_memory.py", "measure"): "a warm-up backward before measuring activations",
    ("bench/gpu_overhead.py", "main"): "a matmul backward that creates cuBLAS's workspace",
    ("zeroshard/tools/sim/calibrate.py", "block_bwd"): "times one block's backward for the simulator, no step",
    ("zeroshard/tools/sim/calibrate.py", "model_bwd"): "times the model's backward for the simulator, no step",
    ("zeroshard/tools/sim/calibrate.py", "run_blocks"): "times blocks' backward (under a collective), no step",
    ("bench/observe_overhead.py", "loop_steps"): "a user's own plain loop, the one zs.observe is measured on",
}

OPTIMIZER_NAMES = ("opt", "optim", "optimizer")


def _receiver(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _is_step_call(call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "backward":
        return True
    name = _receiver(func.value).lower()
    return func.attr == "step" and (name in OPTIMIZER_NAMES or name.endswith(("_opt", "_optim", "optimizer")))


def step_calls(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every backward / optimizer-step call in ``path``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and _is_step_call(child):
                found.append((function, child.lineno))
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def all_step_calls() -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for function, line in step_calls(path):
                out.setdefault((rel, function), []).append(line)
    return out


def test_no_training_loop_outside_the_step_module():
    stray = {f"{path}:{lines[0]} in {function}()": lines
             for (path, function), lines in all_step_calls().items() if (path, function) not in ALLOWED}
    assert not stray, ("a forward/backward/optimizer-step loop outside zeroshard/trainer/step.py; call "
                       f"zeroshard.trainer.step (with its hooks) instead: {sorted(stray)}")


def test_the_allow_list_is_current():
    """Every allowed site still exists, so the list cannot quietly cover code that moved."""
    calls = all_step_calls()
    assert not [key for key in ALLOWED if key not in calls]


def test_the_scan_finds_a_new_loop(tmp_path):
    """The detector itself: a hand-written loop in a tool is found, a plain method call is not."""
    tool = tmp_path / "tool.py"
    tool.write_text(
        "def measure(model, opt, x, y, reporter):\n"
        "    loss = model(x, y)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    reporter.step(loss)\n"
    )
    assert step_calls(tool) == [("measure", 3), ("measure", 4)]
