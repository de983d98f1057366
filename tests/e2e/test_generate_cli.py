"""`zeroshard generate` on a save_pretrained folder and on a sharded checkpoint, against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from test_cli import run_cli  # noqa: E402

from zeroshard.cli.main import main  # noqa: E402
from zeroshard.tools.generate import open_model  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1"}
WORDS = "the cat sat on a mat and dog ran far away to see big red sun".split()


def tiny_llama_with_tokenizer(folder: Path) -> None:
    """A random 2-layer Llama and a word-level tokenizer built here (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    fast.save_pretrained(folder)


def hf_greedy(folder: Path, ids: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
    return out[0, len(ids):].tolist()


def gen_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "llama"
    tiny_llama_with_tokenizer(path)
    return path


def test_greedy_on_folder_is_deterministic_and_equals_transformers_generate(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = gen_json(capsys, [str(folder), "--prompt", "the cat sat on", "--max-new-tokens", "12"])
    again = gen_json(capsys, [str(folder), "--prompt", "the cat sat on", "--max-new-tokens", "12"])
    assert first == again
    assert len(first["new_ids"]) == 12 and first["prompt_ids"] == [3, 4, 5, 6]
    assert first["new_ids"] == hf_greedy(folder, first["prompt_ids"], 12)
    assert isinstance(first["text"], str)


def test_sampling_is_reproducible_with_seed_and_top_k_bounds_the_choice(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(folder), "--prompt-ids", "3,4,5", "--max-new-tokens", "16", "--temperature", "1.5"]
    a = gen_json(capsys, [*args, "--top-k", "5", "--seed", "7"])
    b = gen_json(capsys, [*args, "--top-k", "5", "--seed", "7"])
    others = [gen_json(capsys, [*args, "--top-k", "5", "--seed", str(s)])["new_ids"] for s in range(8, 12)]
    assert a == b
    assert any(o != a["new_ids"] for o in others), "different seeds must be able to sample differently"
    # top-k 1 is greedy whatever the temperature and seed
    greedy = gen_json(capsys, [str(folder), "--prompt-ids", "3,4,5", "--max-new-tokens", "16"])
    top1 = gen_json(capsys, [*args, "--top-k", "1", "--seed", "3"])
    assert top1["new_ids"] == greedy["new_ids"]


def test_sharded_checkpoint_generates_like_its_exported_folder(
        folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, run_dir, out = tmp_path / "ck", tmp_path / "run", tmp_path / "out"
    trained = run_cli(["train", "--model", str(folder), "--stage", "3", "--nproc", "2", "--steps", "2",
                       "--batch", "4", "--seq-len", "16", "--num-samples", "32", "--lr", "3e-2",
                       "--save-every", "2", "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir)], env=OFFLINE)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    result = gen_json(capsys, [str(ckpt), "--prompt", "the dog ran", "--max-new-tokens", "10"])
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before, "generate must write nothing"
    assert result["prompt_ids"] == [3 + WORDS.index(w) for w in ("the", "dog", "ran")]  # the run's tokenizer

    assert main(["ckpt", "export", str(ckpt), "--hf", str(out)]) == 0
    assert result["new_ids"] == hf_greedy(out, result["prompt_ids"], 10)
    # The params read in place from the rank files are the exported ones, and training moved them.
    loaded = dict(open_model(ckpt).model.named_parameters())
    exported = dict(transformers.AutoModelForCausalLM.from_pretrained(out).named_parameters())
    source = dict(transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    assert loaded.keys() == exported.keys()
    assert all(torch.equal(loaded[k], exported[k]) for k in loaded)
    assert any(not torch.equal(loaded[k], source[k]) for k in loaded)


def test_missing_path_and_bad_input_are_one_line_errors(
        folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "nope" in err[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["generate", str(empty), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty" in err[0]
    assert main(["generate", str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "100"]) == 1
    assert "positions" in capsys.readouterr().err
    assert main(["generate", str(folder), "--prompt-ids", "1,2", "--temperature", "-1"]) == 1
    assert "--temperature" in capsys.readouterr().err
    assert main(["generate", str(folder), "--prompt", "the", "--prompt-ids", "1"]) == 1
    assert "not both" in capsys.readouterr().err
