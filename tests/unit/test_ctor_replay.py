"""Constructor replay on one rank: unusual constructors stay bitwise, bad input is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard as zs
from zeroshard.runtime.construct import record_build
from zeroshard.runtime import get_engine


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


class Unusual(nn.Module):
    """Init code that a one-op-per-param replay would get wrong: reads of other params, in-place
    arithmetic, advanced indexing, ``.data`` reassignment, random temporaries in between, an explicit
    generator, a rejection-sampling ``trunc_normal_`` and a buffer sharing a param's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 24)
        self.b = nn.Linear(16, 24)
        self.c = nn.Linear(24, 8)
        self.d = nn.Parameter(torch.empty(6, 6))
        self.e = nn.Parameter(torch.empty(5, 7))
        self.f = nn.Linear(7, 7, bias=False)
        torch.randn(3)  # a random temporary between param inits
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight * 0.5)  # reads a, writes b
            self.a.weight += 0.25  # in-place dunder on a
            self.c.bias[[0, 2]] = self.c.bias[[1, 3]]  # advanced indexing read and write
            torch.mul(self.a.bias, 2.0, out=self.c.bias[:0].new_empty(24))  # a read into an untracked out
        nn.init.orthogonal_(self.d)
        nn.init.trunc_normal_(self.e, std=0.02, a=-0.01, b=0.01)  # rejection sampling: copy_ from a temporary
        gen = torch.Generator().manual_seed(99)
        nn.init.normal_(self.f.weight, generator=gen)
        self.f.weight.data = self.f.weight.data * 3  # .data reassigned: a new storage
        self.register_buffer("view_of_a", self.a.bias.data[:4])
        self.scale = nn.Parameter(torch.ones(2) * 0.5)  # computed out of place


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.emb = nn.Embedding(64, 32)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.data.normal_(0, 0.02)


def _plain(build):
    torch.manual_seed(11)
    model = build()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


@pytest.mark.parametrize("build", [Unusual, Tiny], ids=["unusual", "tiny"])
@pytest.mark.parametrize("stage", [0, 3])
def test_unusual_constructors_are_bitwise_a_plain_build(build, stage):
    expected, rng = _plain(build)
    torch.manual_seed(11)
    model = zs.shard(build, stage=stage)
    assert torch.equal(torch.get_rng_state(), rng), "the RNG must end where a plain build leaves it"
    got = zs.full_state_dict(model)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert get_engine(model).init_stats["path"] == "constructor"


def test_only_params_that_cannot_be_replayed_are_held_whole():
    torch.manual_seed(11)
    built = record_build(Unusual)
    held = {name for name, p in built.model.named_parameters() if built.values[id(p)][0].recipe is None}
    # b copies a; orthogonal_ (d) and trunc_normal_'s rejection sampler (e) copy in a temporary;
    # f's .data was replaced; c.bias was written from a copy of itself (advanced indexing); a.bias
    # shares storage with a buffer; scale is computed out of place. The rest have recipes.
    assert held == {"b.weight", "d", "e", "f.weight", "c.bias", "a.bias", "scale"}
    torch.manual_seed(11)
    built = record_build(Tiny)
    largest = max(p.numel() * p.element_size() for p in built.model.parameters())
    assert all(entry.recipe is not None for entry, _ in built.values.values())
    assert built.peak_real_bytes <= largest, "a reproducible param is real only while its init runs"


def test_bad_build_input_is_refused():
    with pytest.raises(ValueError, match="nn.Module or a function"):
        zs.shard(42, stage=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an nn.Module"):
        zs.shard(lambda: 42, stage=3)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="drop them"):
        zs.shard(Tiny, stage=3, init_fn=lambda m: None)
    with pytest.raises(ValueError, match="on the meta device"):
        zs.shard(lambda: nn.Linear(3, 3, device="meta"), stage=3)


def test_a_failing_build_leaves_every_param_with_its_values():
    expected, _ = _plain(Tiny)
    seen: list[nn.Module] = []

    def failing() -> nn.Module:
        seen.append(Tiny())
        raise RuntimeError("boom in the constructor")

    torch.manual_seed(11)
    with pytest.raises(RuntimeError, match="boom in the constructor"):
        zs.shard(failing, stage=3)
    state = seen[0].state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert "tensor" in repr(seen[0].emb.weight)  # printable: every storage is whole again


def _transformers_configs():
    tf = pytest.importorskip("transformers")
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return {"llama": tf.LlamaConfig(**small, tie_word_embeddings=False),
            "qwen2-tied": tf.Qwen2Config(**small, tie_word_embeddings=True),
            "gpt2-conv1d": tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                         bos_token_id=0, eos_token_id=0)}


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gpt2-conv1d"])
def test_models_written_by_transformers_need_no_init_fn(name):
    """``from_config`` as written (nested post_init, Conv1D drawing without reset_parameters, a
    head tied after its own draw) is bitwise at stage 3, and every param replays (none held whole)."""
    tf = pytest.importorskip("transformers")
    cfg = _transformers_configs()[name]
    expected, rng = _plain(lambda: tf.AutoModelForCausalLM.from_config(cfg))
    torch.manual_seed(11)
    model = zs.shard(lambda: tf.AutoModelForCausalLM.from_config(cfg), stage=3)
    assert torch.equal(torch.get_rng_state(), rng)
    got = zs.full_state_dict(model)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert get_engine(model).init_stats["held_whole_bytes"] == 0
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == cfg.tie_word_embeddings
