"""`zeroshard generate (CKPT | HF_FOLDER) --prompt TEXT`: decode from a checkpoint or a pretrained folder.

A checkpoint is read in place (its params filled straight from the rank files, nothing
consolidated on disk). Greedy by default; --temperature and/or --top-k sample, reproducibly with --seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"zeroshard generate: error: --prompt-ids must be comma-separated integers, got {text!r}")


def cmd_generate(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.tools.generate import decode, encode, generate, open_model
    from zeroshard.checkpoint.hf.errors import PretrainedError

    try:
        gen = open_model(args.path)
        prompt = encode(gen, args.prompt, _ids(args.prompt_ids))
        new = generate(gen, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed)
    except (CheckpointError, PretrainedError, ValueError, OSError) as e:
        print(f"zeroshard generate: error: {e}", file=sys.stderr, flush=True)
        return 1
    text = decode(gen, new)
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "new_ids": new, "text": text}))
    else:
        print(text if text is not None else " ".join(map(str, new)))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint or a pretrained folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="CKPT_OR_FOLDER")
    p.add_argument("--prompt", default=None, help="prompt text (tokenizer, or UTF-8 bytes for a byte-level model)")
    p.add_argument("--prompt-ids", default=None, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (sampled output is reproducible)")
    p.add_argument("--json", action="store_true", help="print prompt ids, new ids and text as JSON")
    p.set_defaults(run=cmd_generate)
