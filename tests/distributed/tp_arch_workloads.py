"""Workers for tensor parallelism on architectures zeroshard has no line for: small random
save_pretrained folders (>= 3 shards, 4 blocks) whose configs declare ``base_model_tp_plan``, each
trained at stage 3 on 4 ranks = 2 shard x 2 tp, as `zeroshard verify --model DIR --nproc 4
--stage 3 --tp 2` runs it. The suite uses a few (SUITE); scripts/arch_matrix.py runs them all.

Module level so spawned ranks can import it; one process group runs every architecture.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig

VOCAB = 96
STEPS = 3
SHARD_BYTES = "20KB"  # every folder spans >= 3 safetensors files
DENSE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             max_position_embeddings=32, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SUITE = ("phi3", "qwen3")
"""The suite's subset, the styles beyond Llama's colwise/rowwise (which tests/distributed/test_tp.py
covers): fused projections gathered whole (Phi-3's qkv_proj and gate_up_proj, colwise_gather_output
and rowwise_split_input), per-head norms whose grads sum over tp (Qwen3's replicated_with_grad_allreduce)."""


def configs() -> dict:
    """One small config per architecture, keyed by model_type; each declares a tensor-parallel plan."""
    import transformers as tf

    head = dict(head_dim=8)
    return {
        "mistral": tf.MistralConfig(**DENSE, **head),
        "gemma2": tf.Gemma2Config(**DENSE, **head, sliding_window=8, query_pre_attn_scalar=8),
        "phi3": tf.Phi3Config(**DENSE),
        "olmo2": tf.Olmo2Config(**DENSE),
        "qwen3": tf.Qwen3Config(**DENSE, **head),
        "cohere": tf.CohereConfig(**DENSE),
        "granite": tf.GraniteConfig(**DENSE),
        "starcoder2": tf.Starcoder2Config(**DENSE),
        "glm": tf.GlmConfig(**DENSE, **head),
        "helium": tf.HeliumConfig(**DENSE, **head),
        "phi": tf.PhiConfig(**DENSE),
        "smollm3": tf.SmolLM3Config(**DENSE),
        "exaone4": tf.Exaone4Config(**DENSE),
        "gemma3_text": tf.Gemma3TextConfig(**DENSE, **head, sliding_window=8, query_pre_attn_scalar=8),
        "olmo3": tf.Olmo3Config(**DENSE),
    }


def make_folders(root: Path, names: tuple[str, ...] | None = None) -> dict[str, Path]:
    import transformers as tf

    out = {}
    for name, config in configs().items():
        if names is not None and name not in names:
            continue
        torch.manual_seed(0)
        out[name] = root / name
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(out[name], max_shard_size=SHARD_BYTES)
    return out


def train_config(folder: str, **overrides) -> TrainConfig:
    """What `zeroshard verify --model FOLDER --nproc 4 --stage 3 --tp 2 --steps 3` runs."""
    return TrainConfig(**{**dict(model=folder, stage=3, nproc=4, tp=2, batch=4, seq_len=16, steps=STEPS, warmup=1,
                                 num_samples=64, dropout=False, profile=False), **overrides})


def suite(folders: dict[str, str], nano: bool = False, steps: int = STEPS, tp: int = 2) -> dict:
    """Per architecture: ``steps`` training steps at stage 3, ``tp`` (losses, full params), or the one-line
    refusal; with ``nano``, NanoGPT through its own spec too (under "nanoGPT"); on rank 0."""
    from zeroshard.trainer.train import setup, train_step

    out: dict = {}
    mesh = zs.init(tp=tp)
    if nano:
        out["nanoGPT"] = _nano_train(mesh)
    for name, folder in folders.items():
        cfg = train_config(folder, steps=steps, tp=tp)
        try:
            run = setup(cfg, mesh)
        except ValueError as exc:  # refused by name before anything is split
            out[name] = {"refused": str(exc)}
            continue
        losses = [train_step(run, step).loss for step in range(steps)]
        state = zs.full_state_dict(run.model)  # collective
        out[name] = {"losses": losses, "params": {k: v.detach().float().clone() for k, v in state.items()}}
    zs.shutdown()
    return out if mesh.rank == 0 else {}


def _full_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """A param's grad in the model's own layout (a tp part's joined, a partial sum summed)."""
    from torch.distributed.tensor import DTensor, Replicate

    from zeroshard.runtime import tp as tp_layout

    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    spec = tp_layout.spec_of(param)
    if spec is None or spec.shard_dim is None:
        return grad.redistribute(placements=[Replicate()]).to_local()
    parts = grad.redistribute(placements=list(spec.placements)).full_tensor().chunk(spec.mesh.size(), spec.shard_dim)
    return tp_layout.canonical(list(parts), spec.describe())


NULL_GRAD = 1e-12
"""A float64 grad this small against the largest is zero in exact arithmetic (an embedding row no
token of the batch uses, a key bias's unrotated dims)."""


def grad_suite(folders: dict[str, str], dtype: str = "float32") -> dict:
    """Per architecture on 2 ranks = tp 2: the largest difference between the split model's grads
    and one process's on one batch, and the largest grad (what rounding is measured against); the
    model cast to ``dtype`` (float64 shows what is left once rounding is 2^29 times smaller)."""
    from zeroshard.checkpoint.hf.pretrained import plain_pretrained
    from zeroshard.models.hf import hf_loss_sum

    zs.init(tp=2)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, folder in folders.items():
        grads = []
        for split in (False, True):
            model = plain_pretrained(folder).to(getattr(torch, dtype)).eval()
            if split:
                try:
                    zs.tensor_parallel(model)
                except ValueError as exc:
                    out[name] = {"refused": str(exc)}
                    break
            total, count = hf_loss_sum(model, ids, ids.roll(-1, dims=1))
            (total / count).backward()
            grads.append({n: _full_grad(p) for n, p in model.named_parameters()})
        else:
            ref, got = grads
            largest = max(g.abs().max().item() for g in ref.values())
            # Elements whose grad is zero but for rounding (a key bias's dims that rotary leaves
            # alone: softmax ignores a shift shared by every key): Adam at eps=1e-8 steps them by
            # rounding noise, in any run.
            null = {n: g.abs() <= NULL_GRAD * largest for n, g in ref.items()
                    if bool((g.abs() <= NULL_GRAD * largest).any())}
            out[name] = {"diff": max((got[n] - ref[n]).abs().max().item() for n in ref), "largest": largest,
                         "null": null}
    zs.shutdown()
    return out


# -- a model of the user's own, through a spec the user writes ---------------------------------------
class NanoAttention(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(width, 3 * width)  # q, k and v stacked by rows
        self.c_proj = torch.nn.Linear(width, width)
        self.head_dim = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tp each of q, k, v holds this rank's heads: their count is read from the width.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class NanoBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = NanoAttention(width, heads)
        self.mlp = torch.nn.ModuleDict(dict(c_fc=torch.nn.Linear(width, 4 * width), c_proj=torch.nn.Linear(4 * width,
                                                                                                          width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(torch.nn.functional.gelu(self.mlp.c_fc(self.ln_2(x))))


class NanoGPT(torch.nn.Module):
    """nanoGPT's layout: blocks under ``transformer.h``, fused ``c_attn``, ``c_fc``/``c_proj``, a tied head."""

    def __init__(self, vocab: int, width: int = 32, heads: int = 4, layers: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(vocab, width), wpe=torch.nn.Embedding(seq, width),
            h=torch.nn.ModuleList(NanoBlock(width, heads) for _ in range(layers)), ln_f=torch.nn.LayerNorm(width)))
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def nano_spec() -> zs.ModelSpec:
    """The spec a user writes for NanoGPT (docs/model_specs.md shows the same)."""
    h = "transformer.h.*"
    return zs.ModelSpec(name="nanoGPT", blocks="transformer.h", before=("transformer.wte", "transformer.wpe"),
                        after=("transformer.ln_f", "lm_head"),
                        tp_plan={f"{h}.attn.c_attn": "colwise", f"{h}.attn.c_proj": "rowwise",
                                 f"{h}.mlp.c_fc": "colwise", f"{h}.mlp.c_proj": "rowwise"},
                        tp_chunks={f"{h}.attn.c_attn": 3}, tp_divides={"n_head": 4},
                        sequence_norms=("ln_1", "ln_2"), stream_inputs=False)


NANO_STEPS = 3
NANO_EPS = 1e-6
"""AdamW's eps for NanoGPT, as tp_workloads' Llama: the key bias's grad is zero in exact arithmetic
(softmax ignores a shift shared by every key), so its fp32 value is rounding noise of about 1e-9,
which TP's other summation order changes; at eps=1e-8 Adam would scale that noise up to a step of
lr (6.8e-5 of param difference after 3 steps, measured); at 1e-6 the run is within 6.3e-7."""


def nano_reference() -> dict:
    """One process, plain PyTorch: the numbers the tp run must equal."""
    return _nano_train(None)


def _nano_train(mesh) -> dict:
    import tp_workloads as tw
    from zeroshard.trainer import step
    from zeroshard.trainer.adapter import mean_loss
    from zeroshard.trainer.data import GlobalBatchSampler, collate

    data = tw.dataset()
    torch.manual_seed(tw.SEED)
    model = NanoGPT(data.vocab_size, seq=tw.SEQ_LEN)
    if mesh is None:
        opt = torch.optim.AdamW(zs.optim_groups(model, tw.WEIGHT_DECAY), lr=tw.LR, betas=(0.9, 0.95), eps=NANO_EPS)
        sampler = GlobalBatchSampler(len(data), tw.GLOBAL_BATCH, world=1, rank=0, seed=tw.SEED)
        for _ in range(NANO_STEPS):
            x, y = collate(data, sampler.next_indices())
            mean_loss(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tw.CLIP)
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    zs.tensor_parallel(model, spec=nano_spec())
    cfg = TrainConfig(stage=3, nproc=mesh.world, batch=tw.GLOBAL_BATCH, seq_len=tw.SEQ_LEN, lr=tw.LR, min_lr=tw.LR,
                      warmup=0, weight_decay=tw.WEIGHT_DECAY, clip=tw.CLIP, seed=tw.SEED)
    run = step.build(cfg, mesh, model=model, dataset=data)
    for group in run.opt.param_groups:
        group["eps"] = NANO_EPS
    for _ in range(NANO_STEPS):
        x, y = collate(run.dataset, run.sampler.next_indices())
        step.step(run, x, y)
    return zs.full_state_dict(run.model)
