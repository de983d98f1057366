"""Token-file datasets and `zeroshard data prepare`, with a tokenizer built locally (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from zeroshard.cli.data import prepare
from zeroshard.cli.main import main
from zeroshard.trainer.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.trainer.data_tokens import TokenFileDataset, dtype_for_vocab

DOCS = Path(__file__).resolve().parents[2] / "docs"


def make_tokenizer(directory: Path, texts: list[Path], vocab: int = 300) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` and saved as DIR/tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(t) for t in texts], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer, list[Path]]:
    root = tmp_path_factory.mktemp("tok")
    texts = [DOCS / "checkpoints.md", DOCS / "workflow.md"]
    tok = make_tokenizer(root / "tokenizer", texts)
    prepare(texts, root / "tokenizer", root / "out", show_progress=False)
    return root / "out", tok, texts


def test_prepare_writes_raw_tokens_and_meta(prepared):
    out, tok, texts = prepared
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size()
    assert meta["files"] == ["00000-checkpoints.bin", "00001-workflow.bin"]
    for name, text, count in zip(meta["files"], texts, meta["tokens"]):
        raw = np.fromfile(out / name, dtype="<u2")
        assert len(raw) == count == (out / name).stat().st_size // 2
        # Chunks split at line ends; a byte-level BPE never merges across "\n", so same ids.
        assert raw.tolist() == tok.encode(text.read_text(), add_special_tokens=False).ids
    assert not list(out.glob(".*.partial"))


def test_windows_are_consecutive_tokens_per_file(prepared):
    out, _, _ = prepared
    ds = build_dataset(data_path=out, seq_len=16)
    assert isinstance(ds, TokenFileDataset)
    files = [np.fromfile(f, dtype="<u2").astype(np.int64) for f in sorted(out.glob("*.bin"))]
    assert len(ds) == sum(len(f) // 17 for f in files)
    n0 = len(files[0]) // 17
    x, y = ds[0]
    assert x.tolist() == files[0][:16].tolist() and y.tolist() == files[0][1:17].tolist()
    x, y = ds[n0]  # the first window of the second file: windows never straddle files
    assert x.tolist() == files[1][:16].tolist()
    x, y = ds[-1]
    assert y[-1].item() == files[1][(len(files[1]) // 17) * 17 - 1]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_resume_mid_epoch_at_another_world_sees_each_window_once(prepared):
    out, _, _ = prepared
    ds = TokenFileDataset(out, seq_len=16)
    full = GlobalBatchSampler(len(ds), 8, world=1, seed=3)
    epoch = [full.next_indices() for _ in range(full.steps_per_epoch)]
    # Three steps at world 2, checkpoint, then the rest of the epoch at world 1.
    ranks = [GlobalBatchSampler(len(ds), 8, world=2, rank=r, seed=3) for r in (0, 1)]
    seen = [ranks[0].next_indices() + ranks[1].next_indices() for _ in range(3)]
    resumed = GlobalBatchSampler(len(ds), 8, world=1, seed=99)
    resumed.load_state_dict(ranks[0].state_dict())
    seen += [resumed.next_indices() for _ in range(full.steps_per_epoch - 3)]
    assert seen == epoch
    flat = [i for batch in seen for i in batch]
    assert len(flat) == len(set(flat)) == full.steps_per_epoch * 8  # no repeats, none skipped
    x, _ = collate(ds, seen[3])
    assert x.shape == (8, 16)


def test_nanogpt_folder_without_meta_reads_train_bin(tmp_path):
    train = np.arange(1000, dtype="<u2") % 500
    train.tofile(tmp_path / "train.bin")
    np.full(100, 7, dtype="<u2").tofile(tmp_path / "val.bin")
    ds = TokenFileDataset(tmp_path, seq_len=9)
    assert ds.files == [tmp_path / "train.bin"] and len(ds) == 100 and ds.vocab_size == 500
    assert ds[1][0].tolist() == list(range(10, 19))


def test_uint32_tokens_from_meta(tmp_path):
    assert dtype_for_vocab(65536) == "uint16" and dtype_for_vocab(65537) == "uint32"
    np.array([70000, 1, 2, 3, 4], dtype="<u4").tofile(tmp_path / "a.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 100000}))
    ds = TokenFileDataset(tmp_path, seq_len=4)
    assert ds.vocab_size == 100000 and ds[0][0].tolist() == [70000, 1, 2, 3]


def test_token_file_with_partial_token_names_the_file(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(ValueError, match=r"train\.bin has 5 bytes, not a whole number of 2-byte"):
        TokenFileDataset(tmp_path, seq_len=1)


def test_meta_vocab_smaller_than_tokens_is_rejected(tmp_path):
    np.array([1, 2, 300, 3], dtype="<u2").tofile(tmp_path / "a.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    ds = TokenFileDataset(tmp_path, seq_len=1)
    assert ds[0][0].tolist() == [1]
    with pytest.raises(ValueError, match=r"a\.bin holds id 300 but .*vocab_size=256"):
        ds[1]


def test_cli_tokenizer_folder_without_tokenizer_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert main(["data", "prepare", str(DOCS / "workflow.md"), "--tokenizer", str(tmp_path / "empty"),
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "empty" in err and "no tokenizer.json" in err
    assert not out.exists()


def test_cli_missing_text_writes_nothing(prepared, tmp_path, capsys):
    _, tok, _ = prepared
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "out"
    assert main(["data", "prepare", str(tmp_path / "nope.txt"), "--tokenizer", str(tmp_path),
                 "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope.txt" in err
    assert not out.exists()


def test_train_on_a_truncated_token_file_fails_before_any_rank_starts(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.bin").write_bytes(b"\x01\x00\x02")
    run_dir = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "data"), "--model", "tiny", "--nproc", "1",
                 "--steps", "1", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.bin has 3 bytes" in err
    assert not run_dir.exists()


def test_cli_tokenizer_config_without_vocabulary_writes_nothing(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    out = tmp_path / "out"
    assert main(["data", "prepare", str(DOCS / "workflow.md"), "--tokenizer", str(tmp_path / "tok"),
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tok" in err and "no vocabulary" in err
    assert not out.exists()


def test_prepare_reads_a_save_pretrained_folder(prepared, tmp_path):
    from transformers import PreTrainedTokenizerFast

    _, tok, texts = prepared
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(tmp_path / "hf"))
    meta = prepare(texts[:1], tmp_path / "hf", tmp_path / "out", show_progress=False)
    raw = np.fromfile(tmp_path / "out" / meta["files"][0], dtype="<u2")
    assert raw.tolist() == tok.encode(texts[0].read_text(), add_special_tokens=False).ids
