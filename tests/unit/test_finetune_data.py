"""Record data for fine-tuning: chat and prompt/completion masks, packing that keeps samples apart,
document masks on token windows, the held-out rows each rank evaluates. One process throughout;
tests/distributed/test_finetune.py trains and evaluates on 2 ranks."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

import torch  # noqa: E402

from chat_fixtures import dialogues, make_chat_folder, write_jsonl  # noqa: E402
from zeroshard.models.gpt import GPT, GPTConfig  # noqa: E402
from zeroshard.trainer import adapter  # noqa: E402
from zeroshard.trainer.data import build_dataset, check_data_path, collate, data_tokenizer  # noqa: E402
from zeroshard.trainer.data_pack import RecordDataset, collate_positions, document_positions  # noqa: E402
from zeroshard.trainer.data_records import load_records, tokenize_records  # noqa: E402
from zeroshard.trainer.evaluate import rank_rows  # noqa: E402

SEQ = 192
PACK_SEQ = 320  # two or three dialogues a row


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("finetune")


@pytest.fixture(scope="module")
def folder(root) -> Path:
    return make_chat_folder(root, layers=1)


@pytest.fixture(scope="module")
def tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _trained_text(tok, ids, trained) -> str:
    return tok.decode([i for i, t in zip(ids, trained) if t])


def test_chat_loss_covers_exactly_the_assistant_turns(tok, root):
    records = dialogues(6)
    samples = tokenize_records(load_records(write_jsonl(root / "mask.jsonl", records)), tok)
    for record, sample in zip(records, samples):
        turns = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert record["messages"][0]["role"] == "system" and len(turns) >= 1
        assert _trained_text(tok, sample.ids, sample.trained) == "".join(t + "<|im_end|>\n" for t in turns)
        rendered = tok.apply_chat_template(record["messages"], tokenize=False)
        assert tok.decode(sample.ids) == rendered  # the template's own rendering, nothing added


def test_generation_tags_give_the_same_mask(tok):
    """A template with {% generation %} is asked for its own assistant mask: the same tokens."""
    tagged = copy.deepcopy(tok)  # same vocabulary; only the template differs
    tagged.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                            "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
                            "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    from datasets import Dataset

    records = Dataset.from_list(dialogues(4))
    plain, tagged_samples = tokenize_records(records, tok), tokenize_records(records, tagged)
    for a, b in zip(plain, tagged_samples):
        assert a.ids == b.ids and a.trained == b.trained and sum(a.trained) > 0


def test_prompt_completion_strings_and_messages(tok):
    from datasets import Dataset

    strings = tokenize_records(Dataset.from_list([{"prompt": "what is two plus three", "completion": " five"}]), tok)
    assert _trained_text(tok, strings[0].ids, strings[0].trained) == " five<eos>"
    conv = [{"prompt": [{"role": "system", "content": "you are the cat"}, {"role": "user", "content": "why rain"}],
             "completion": [{"role": "assistant", "content": "because clouds"}]}]
    sample = tokenize_records(Dataset.from_list(conv), tok)[0]
    assert _trained_text(tok, sample.ids, sample.trained) == "because clouds<|im_end|>\n"
    assert tok.decode(sample.ids).startswith("<|im_start|>system\nyou are the cat")


def test_parquet_arrow_and_jsonl_give_the_same_rows(folder, root):
    from datasets import Dataset

    records = dialogues(10) + [{"messages": [{"role": "user", "content": "hi"}]}]  # nothing to train: dropped
    rows = Dataset.from_list(records)
    write_jsonl(root / "d.jsonl", records)
    rows.to_parquet(str(root / "d.parquet"))
    rows.save_to_disk(str(root / "d-arrow"))
    built = [build_dataset(data_path=root / name, seq_len=SEQ, tokenizer=str(folder))
             for name in ("d.jsonl", "d.parquet", "d-arrow")]
    assert built[0].dropped == 1 and len(built[0].samples) == 10
    for other in built[1:]:
        assert len(other) == len(built[0])
        for i in range(len(other)):
            assert all(torch.equal(a, b) for a, b in zip(other[i], built[0][i]))
            assert torch.equal(other.positions(i), built[0].positions(i))


def _packed_pair(tok, n: int) -> tuple[RecordDataset, RecordDataset]:
    from datasets import Dataset

    samples = tokenize_records(Dataset.from_list(dialogues(n, seed=5)), tok)
    kw = dict(pad_id=tok.pad_token_id, vocab_size=len(tok))
    return RecordDataset(samples, PACK_SEQ, packing=True, **kw), RecordDataset(samples, PACK_SEQ, packing=False, **kw)


def _loss(model, dataset, positions: bool = True) -> tuple[float, int]:
    idx = list(range(len(dataset)))
    x, y = collate(dataset, idx)
    total, count = adapter.loss_sum(model, x, y, collate_positions(dataset, idx) if positions else None)
    return float(total) / int(count), int(count)


@pytest.mark.parametrize("kind", ["gpt", "hf-folder"])
def test_packed_rows_give_the_unpacked_loss(tok, folder, kind):
    packed, padded = _packed_pair(tok, 9)
    assert len(packed) < len(padded) // 2, "the rows must hold several samples each"
    if kind == "gpt":
        torch.manual_seed(0)
        model = GPT(GPTConfig.named("tiny", vocab_size=len(tok), seq_len=PACK_SEQ))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
    with torch.no_grad():
        (a, n_packed), (b, n_padded) = _loss(model, packed), _loss(model, padded)
        leaky, _ = _loss(model, packed, positions=False)  # the same rows, samples attending to each other
    print(f"{kind}: packed {a:.8f}  padded {b:.8f}  |diff| {abs(a - b):.1e}  packed without positions {leaky:.6f}")
    assert n_packed == n_padded and abs(a - b) <= 1e-6
    assert abs(leaky - b) > 10 * 1e-6  # the check can fail: without positions the samples mix


def test_masked_tokens_contribute_nothing_to_the_grads(tok, folder):
    """Tokens the loss skips (a trailing user turn, the pads) change no grad when their content changes."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    def grads(user_tail: str, pad: int) -> dict[str, torch.Tensor]:
        records = dialogues(3, seed=9)
        for r in records:
            r["messages"].append({"role": "user", "content": user_tail})
        samples = tokenize_records(Dataset.from_list(records), tok)
        data = RecordDataset(samples, SEQ, packing=True, pad_id=pad, vocab_size=len(tok))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        idx = list(range(len(data)))
        x, y = collate(data, idx)
        total, count = adapter.loss_sum(model, x, y, collate_positions(data, idx))
        (total / count).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    base = grads("why does rain fall", tok.pad_token_id)
    other = grads("blue rivers run far away and the cat sat", 7)
    diff = max((base[n] - other[n]).abs().max().item() for n in base)
    print(f"max |grad diff| after changing masked tokens: {diff:.1e}")
    assert diff <= 1e-7 and max(g.abs().max().item() for g in base.values()) > 0


def test_document_positions_restart_after_each_eos():
    x = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 1, 4]])
    assert document_positions(x, eos_id=1).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]


def test_each_held_out_row_is_evaluated_once_over_the_ranks():
    for rows, micro, dp in [(11, 3, 2), (4, 2, 2), (1, 4, 4)]:
        per_rank = [rank_rows(rows, micro, dp, r) for r in range(dp)]
        assert len({len(b) for b in per_rank}) == 1  # the same number of forwards on every rank
        seen = [i for batches in per_rank for batch in batches for i in batch if i is not None]
        assert sorted(seen) == list(range(rows))


def test_record_data_without_a_tokenizer_is_one_line(root):
    path = write_jsonl(root / "t.jsonl", [{"text": "the cat"}])
    with pytest.raises(ValueError, match="need a tokenizer: pass --model DIR"):
        build_dataset(data_path=path, seq_len=8)
    with pytest.raises(ValueError, match="need a tokenizer: pass --model DIR"):  # before any rank starts
        check_data_path(str(path), 8, data_tokenizer("tiny", None))
    with pytest.raises(ValueError, match="does not exist"):
        check_data_path(str(root / "missing.parquet"), 8, str(root / "chat-model"))
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match="expected 'text', 'messages'"):
        build_dataset(data_path=bad, seq_len=8, tokenizer=str(root / "chat-model"))


def test_eval_figures_reach_the_loggers_under_eval():
    from zeroshard.observing.loggers import scalars

    logged = scalars({"step": 3, "loss": 2.5, "eval_loss": 2.0, "eval_perplexity": 7.389, "eval_tokens": 57})
    assert (logged["eval/loss"], logged["eval/perplexity"], logged["train/loss"]) == (2.0, 7.389, 2.5)


def test_prepare_ends_every_document_with_eos_and_doc_mask_restarts_there(folder, tok, root):
    import numpy as np

    from zeroshard.cli.data import prepare

    texts = [{"text": f"the cat sat on mat {i}"} for i in range(30)]
    text_file = root / "corpus.txt"
    text_file.write_text("blue rivers run far away\n" * 20)
    meta = prepare([write_jsonl(root / "docs.jsonl", texts), text_file], folder, root / "tokens", show_progress=False)
    assert meta["eos_id"] == tok.eos_token_id
    records, whole = (np.fromfile(root / "tokens" / name, dtype="<u2").tolist() for name in meta["files"])
    assert records.count(tok.eos_token_id) == len(texts) and records[-1] == tok.eos_token_id
    assert whole.count(tok.eos_token_id) == 1 and whole[-1] == tok.eos_token_id  # a text file is one document
    first = tok(texts[0]["text"], add_special_tokens=False)["input_ids"]
    assert records[:len(first) + 1] == first + [tok.eos_token_id]
    windows = build_dataset(data_path=root / "tokens", seq_len=16, doc_mask=True)
    x, _ = windows[0]
    pos = windows.positions(0)
    ends = [t for t in range(15) if x[t] == tok.eos_token_id]
    assert ends and all(pos[t + 1] == 0 for t in ends) and pos[0] == 0
    assert torch.equal(pos, document_positions(x, tok.eos_token_id))
    with pytest.raises(ValueError, match="doc_mask needs a token folder"):
        build_dataset(data_path=text_file, seq_len=16, doc_mask=True)
