"""Pipeline stages run the model's own forward: every stage of a cut model, run in sequence in one
process (stage s's output fed to stage s+1, as the schedule sends it), gives the whole model's
logits, for every architecture here. This is the check that a stage computes the whole model's
function: an architecture whose stages drop an op of its forward (an embedding scale, a soft-cap,
a sliding window) fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.parallel.pipeline.layout import blocks_path, hidden_width, layout_of, vocab_rows
from zeroshard.tools.planner.pipeline import cut_stages

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
import nano_gpt  # noqa: E402
from pp_arch_configs import VOCAB, pp_arch_configs  # noqa: E402

LOGIT_TOL = 1e-6


SUITE_ARCHS = ("gemma2", "mistral", "phi3", "qwen3", "granite", "gpt2", "falcon", "qwen2_moe")
"""Eight of the shared architectures, each a way of writing a decoder (scripts/pp_archs.py runs all of
them through `zeroshard verify` at pp 2)."""


def hf_configs() -> dict:
    pytest.importorskip("transformers")
    every = pp_arch_configs()
    return {name: every[name] for name in SUITE_ARCHS}


def staged_logits(model: torch.nn.Module, num_stages: int, ids: torch.Tensor, blocks: str | None = None):
    """The stages the runtime cuts (the tied head's copy included), run one after another."""
    stages = cut_stages(model, num_stages, blocks)[0]
    x = ids
    for stage in stages:
        x = stage(x)
    return x, stages


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", list(hf_configs()))
def test_hf_stages_in_sequence_give_the_models_own_logits(name):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_configs()[name]).eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        diffs = [(staged_logits(model, n, ids)[0] - ref).abs().max().item() for n in (2, 4)]
    print(f"{name}: max|staged - whole| at 2 and 4 stages: {diffs}")
    assert max(diffs) <= LOGIT_TOL


def test_stages_backpropagate_the_models_own_grads():
    """Gemma2 at 2 stages: the received hidden state's grad flows to the first stage, and every
    param's grad equals the whole model's."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(hf_configs()["gemma2"])
    ids = _ids()
    model(input_ids=ids).logits.square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, stages = staged_logits(model, 2, ids)
    logits.square().mean().backward()
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    grads["model.embed_tokens.weight"] = grads["model.embed_tokens.weight"] + grads.pop("lm_head.weight")  # the tie
    assert set(grads) == set(ref)
    assert max((grads[n] - ref[n]).abs().max().item() for n in ref) <= 1e-6


def test_zeroshards_gpt_stages_give_its_logits():
    model = GPT(GPTConfig.named("tiny"))
    ids = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
        assert (staged_logits(model, 2, ids)[0] - ref).abs().max().item() <= LOGIT_TOL
    assert blocks_path(model) == "blocks"


def test_a_users_model_is_cut_through_the_blocks_path_it_gives():
    torch.manual_seed(0)
    model = nano_gpt.NanoGPT(nano_gpt.NanoConfig())
    with pytest.raises(ValueError, match="cannot tell where NanoGPT keeps its blocks; give their dotted path") as e:
        layout_of(model)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="blocks='transformer' is not a non-empty ModuleList of NanoGPT"):
        layout_of(model, "transformer")
    layout = layout_of(model, "transformer.h")
    assert (layout.first, layout.last) == (("transformer.wte", "transformer.wpe"), ("lm_head", "transformer.ln_f"))
    assert (hidden_width(model, layout), vocab_rows(model, layout)) == (32, VOCAB)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids)[0]
        logits, stages = staged_logits(model, 2, ids, "transformer.h")
    assert (logits - ref).abs().max().item() <= LOGIT_TOL
    assert "transformer.wte.weight" in dict(stages[0].named_parameters())
    assert {n for n, _ in stages[1].named_parameters()} >= {"lm_head.weight", "transformer.h.3.c_fc.weight"}


def test_a_module_registered_before_the_blocks_but_run_after_them_is_refused():
    """Modules are placed by where they are registered; a model registering its final norm before its
    blocks would put it on the first stage: the last stage, holding a stand-in, says so instead of
    computing something else."""
    class Late(nano_gpt.NanoGPT):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.final = self.transformer.ln_f
            del self.transformer.ln_f
            self.__dict__["_modules"] = {"final": self.final, **self._modules}

        def forward(self, idx):
            x = self.transformer.wte(idx)
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.final(x))

    model = Late(nano_gpt.NanoConfig())
    with pytest.raises(ValueError, match="final is registered before the blocks but runs after them"):
        staged_logits(model, 2, _ids(), "transformer.h")
