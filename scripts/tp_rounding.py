"""Where the fp32 difference between tensor parallelism and one process comes from, over many steps.

For the matrix's architectures whose params end above 1e-5 of one process at tp 2 (Cohere, GLM,
Gemma3; scripts/arch_matrix.py), trains three runs of the same STEPS steps (the arch matrix's
config: stage 3, AdamW eps 1e-8, the same data and schedule) and compares their params:

- "tp": 4 ranks = 2 shard x 2 tp, fp32, as `zeroshard verify --model DIR --nproc 4 --stage 3 --tp 2`;
- "dp": 4 ranks = 4 shard, fp32, the same at tp 1 (what data parallelism alone does to the sums);
- "one": one process, fp32 (verify's reference, reference_train);
- "f64": one process, the model cast to float64, and every float32 cast in its code (a norm's
  ``x.float()``, softmax's ``dtype=torch.float32``, the loss's fp32 logits) made float64 too
  (Float64Mode): the same steps with rounding 2^29 times smaller, the near-exact answer.

Prints per architecture: the largest param difference of tp and of dp from one; the params that
differ most between tp and one (max |diff|), each with the one-process grad at step 1 and Adam's
denominator sqrt(v_hat) after the last step at that element; then how far each fp32 run is from the
float64 one (max and mean |diff| over every element, and at the elements where tp and one differ
most).

    python scripts/tp_rounding.py [--only cohere,glm] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import tp_arch_workloads as w  # noqa: E402
from zeroshard.trainer.exact import Float64Mode  # noqa: E402

NAMES = ("cohere", "glm", "gemma3_text")
TOP = 6


class StepProbe:
    """Every optimizer step's grads, by param name, and the last optimizer (for Adam's state)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.grads: list[dict[str, torch.Tensor]] = []
        self.opt: torch.optim.Optimizer | None = None

    def __call__(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        self.opt = opt
        self.grads.append({self.names[id(p)]: p.grad.detach().clone() for g in opt.param_groups for p in g["params"]
                           if p.grad is not None and id(p) in self.names})

    def adam_denominator(self) -> dict[str, torch.Tensor]:
        """sqrt(v_hat) per element after the last step: what Adam divides the step's grad by (plus eps)."""
        out = {}
        for group in self.opt.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                state = self.opt.state.get(p, {})
                if "exp_avg_sq" in state and id(p) in self.names:
                    step = float(state["step"])
                    out[self.names[id(p)]] = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt()
        return out


def one_process(folder: str, steps: int, float64: bool) -> tuple[dict, StepProbe, list[float]]:
    from zeroshard.trainer.train import build_data, build_model, reference_train

    cfg = w.train_config(folder, steps=steps)
    model = build_model(cfg, build_data(cfg).vocab_size, torch.device("cpu"), allow_meta=False)
    if float64:
        model = model.double()
    probe = StepProbe(model)
    handle = register_optimizer_step_pre_hook(probe)
    try:
        if float64:
            with Float64Mode():
                losses = reference_train(cfg, model)["losses"]
        else:
            losses = reference_train(cfg, model)["losses"]
    finally:
        handle.remove()
    params = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    return params, probe, losses


def report(name: str, tp: dict, dp: dict, one: tuple, f64: tuple) -> None:
    (one_p, probe, one_losses), (f64_p, _, f64_losses) = one, f64
    runs = {"one": (one_p, one_losses)}
    for who, run in (("tp", tp), ("dp", dp)):
        runs[who] = ({k: v.double() for k, v in run["params"].items()}, run["losses"])
    tp_p = runs["tp"][0]
    denom = probe.adam_denominator()
    first = probe.grads[0]
    diffs = {k: (tp_p[k] - one_p[k]).abs() for k in one_p}
    worst = sorted(diffs, key=lambda k: -diffs[k].max().item())[:TOP]
    dp_one = {k: (runs["dp"][0][k] - one_p[k]).abs().max().item() for k in one_p}
    dp_worst = max(dp_one, key=lambda k: dp_one[k])
    print(f"== {name}: {len(probe.grads)} steps; max |param diff| from one: tp {diffs[worst[0]].max().item():.1e}, "
          f"dp {dp_one[dp_worst]:.1e} ({dp_worst})")
    for k in worst:
        i = int(diffs[k].argmax())
        g1, d = first[k].flatten()[i].abs().item(), denom[k].flatten()[i].item()
        print(f"  {k:42s} |tp - one| {diffs[k].max().item():.1e}; there: step-1 |grad| {g1:.1e}, "
              f"final sqrt(v_hat) {d:.1e}; the param's largest step-1 |grad| {first[k].abs().max().item():.1e}")
    for who, (p, losses) in runs.items():
        d = {k: (p[k] - f64_p[k]).abs() for k in f64_p}
        at = max(d[k].flatten()[int(diffs[k].argmax())].item() for k in worst)
        mean = sum(v.sum().item() for v in d.values()) / sum(v.numel() for v in d.values())
        loss = max(abs(a - b) for a, b in zip(losses, f64_losses))
        print(f"  |{who} - f64|: params max {max(v.max().item() for v in d.values()):.1e}, mean {mean:.1e}, "
              f"at the {TOP} elements above {at:.1e}; loss max {loss:.1e}")


def main() -> int:
    from zeroshard.trainer.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(NAMES))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    names = tuple(n for n in args.only.split(",") if n)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: str(v) for k, v in w.make_folders(Path(tmp), names).items()}
        tp = spawn(w.suite, 4, args=(paths, False, args.steps), timeout_s=3000)[0]
        dp = spawn(w.suite, 4, args=(paths, False, args.steps, 1), timeout_s=3000)[0]
        for name, folder in paths.items():
            report(name, tp[name], dp[name], one_process(folder, args.steps, False),
                   one_process(folder, args.steps, True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
