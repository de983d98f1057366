"""Tensor parallelism on every architecture of the matrix: one line per architecture.

Each is a small random save_pretrained folder (>= 3 shards, 4 blocks) whose config declares a
tensor-parallel plan (tests/distributed/tp_arch_workloads.py), trained 3 steps at stage 3 on 4 ranks
= 2 shard x 2 tp, as `zeroshard verify --model DIR --nproc 4 --stage 3 --tp 2 --steps 3` runs it,
and compared with one process: "pass" with the largest loss and param differences (params <= 1e-5,
losses <= 1e-6), "FAIL" with them, or the one-line refusal. Each line also gives the param that
differs most and, from a second group of 2 ranks = tp 2, how far the split model's grads on one
batch are from one process's against the largest grad: rounding is about 1e-7 of it, while a wrong
split would show errors the size of the grads; the same in float64 leaves only float64's rounding
(about 1e-16 of it), so what differs in fp32 is rounding and nothing else. A param whose float64
grad is zero to 1e-12 of the largest (the dims of GLM's key biases that its partial rotary leaves
alone: softmax ignores a shift shared by every key) has no update to compare: its fp32 grad is
rounding noise, which Adam at eps=1e-8 turns into steps of about lr in any run; those elements'
difference is printed and not held to the tolerance (docs/tensor_parallel.md, "Adam at eps=1e-8").
GPT-2 and Falcon
declare no plan: they are in the matrix to show the refusal. One spawned group of 4 runs them all.

    python scripts/arch_matrix.py [--only mistral,gemma2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed")]  # the workloads' module, as the tests import it

import tp_arch_workloads as w  # noqa: E402

LOSS_TOL = 1e-6


def refused_configs() -> dict:
    import transformers as tf

    small = dict(vocab_size=w.VOCAB)
    return {"gpt2": tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=32, **small),
            "falcon": tf.FalconConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, **small)}


def main() -> int:
    from zeroshard.cli.verify import default_tolerances
    from zeroshard.trainer.launch import spawn
    from zeroshard.trainer.train import reference_train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: all)")
    args = parser.parse_args()
    only = tuple(n for n in args.only.split(",") if n) or None
    tol, loss_tol = default_tolerances("fp32")[0], LOSS_TOL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = w.make_folders(root, only)
        import torch
        import transformers as tf

        for name, config in refused_configs().items():
            if only is None or name in only:
                torch.manual_seed(0)
                folders[name] = root / name
                tf.AutoModelForCausalLM.from_config(config).save_pretrained(folders[name], max_shard_size=w.SHARD_BYTES)
        got = spawn(w.suite, 4, args=({k: str(v) for k, v in folders.items()},), timeout_s=3000)[0]
        paths = {k: str(v) for k, v in folders.items()}
        grads = spawn(w.grad_suite, 2, args=(paths,), timeout_s=1200)[0]
        exact = spawn(w.grad_suite, 2, args=(paths, "float64"), timeout_s=1200)[0]
        failed = 0
        for name, folder in folders.items():
            run = got[name]
            if "refused" in run:
                print(f"{name:12s} refused: {run['refused']}")
                continue
            ref = reference_train(w.train_config(str(folder)))
            g, g64 = grads[name], exact[name]
            loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True))
            # Elements with no gradient in exact arithmetic (float64 grad ~0: a key bias's unrotated
            # dims) have no update to compare: Adam at eps=1e-8 steps them by fp32 rounding noise in
            # every run. Their largest difference is shown, not held; embedding rows the grad batch
            # does not use are zero there too, so the mask is applied to the key biases alone.
            null = {k: m for k, m in g64["null"].items() if k.endswith("k_proj.bias")}
            diffs, unheld = {}, {}
            for k in ref["params"]:
                d = (run["params"][k] - ref["params"][k].float()).abs()
                if k in null:
                    unheld[k] = d[null[k]].max().item()
                    d = d.masked_fill(null[k], 0.0)
                diffs[k] = d.max().item()
            worst = max(diffs, key=lambda k: diffs[k])
            ok = loss <= loss_tol and diffs[worst] <= tol and set(run["params"]) == set(ref["params"])
            failed += not ok
            if unheld:
                print(f"{name:12s} key-bias elements with no grad in exact arithmetic (float64 |grad| <= "
                      f"{w.NULL_GRAD:.0e} of the largest), not held: " + ", ".join(f"{k} {v:.1e}" for k, v in unheld.items()))
            print(f"{name:12s} {'pass' if ok else 'FAIL'}: tp 2 x shard 2, stage 3, {w.STEPS} steps: max |loss diff| "
                  f"{loss:.1e} (tol {loss_tol:.0e}), max |param diff| {diffs[worst]:.1e} (tol {tol:.0e}, {worst}); "
                  f"grads at tp 2: max |diff| {g['diff']:.1e} of max |grad| {g['largest']:.1e}, in float64 "
                  f"{g64['diff']:.1e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
