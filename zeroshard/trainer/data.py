"""Data: a synthetic source with a known loss floor, byte-level text, a resumable sampler.

The synthetic source is what makes numerics testable: a random order-k Markov chain has an
exactly computable entropy rate, so "did training work" becomes "did the loss approach a
number we know", and every run on every world size sees the same tokens.

The sampler's contract is stated in global terms: the global batch for (seed, epoch, step)
does not depend on the world size, and each rank takes a contiguous slice of it. That is what
lets a 1-process run be the numerical reference for an N-rank run, and lets a checkpoint
taken at one world size resume at another.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from zeroshard.trainer.data_windows import NaturalText, check_index, next_token_pair

__all__ = [
    "MarkovSource",
    "TokenDataset",
    "SyntheticDataset",
    "ByteFileDataset",
    "GlobalBatchSampler",
    "collate",
    "build_dataset",
    "check_data_path",
    "data_tokenizer",
]

# Transition tables beyond this many entries (V**(k+1)) stop being "small and fast".
_MAX_TABLE_ENTRIES = 1 << 24


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats along ``axis``, with 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=axis)


class MarkovSource:
    """A seeded random order-``k`` Markov chain over ``vocab_size`` tokens.

    Each context (the previous ``order`` tokens) gets a next-token distribution drawn from
    a symmetric Dirichlet(``concentration``). A small concentration makes the rows sparse,
    so the chain has low entropy and is learnable; a huge one makes it nearly uniform.

    The loss floor: a model that sees at least ``order`` previous tokens can at best predict
    with the true ``P(next | context)``, whose expected cross-entropy is ``entropy_rate()``.
    Positions with fewer than ``order`` tokens of context cost a little more; see
    ``window_floor`` for the exact floor of a training window.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        order: int = 2,
        seed: int = 0,
        concentration: float = 0.1,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"MarkovSource.vocab_size must be >= 2, got {vocab_size}")
        if order < 1:
            raise ValueError(f"MarkovSource.order must be >= 1, got {order}")
        if vocab_size ** (order + 1) > _MAX_TABLE_ENTRIES:
            raise ValueError(
                f"MarkovSource with vocab_size={vocab_size} and order={order} needs a "
                f"{vocab_size}**{order + 1}-entry transition table (limit {_MAX_TABLE_ENTRIES}); "
                f"lower vocab_size or order"
            )
        if not concentration > 0:
            raise ValueError(f"MarkovSource.concentration must be > 0, got {concentration}")
        self.vocab_size = vocab_size
        self.order = order
        self.seed = seed
        self.concentration = concentration
        self.n_states = vocab_size**order
        rng = np.random.default_rng(seed)
        alpha = np.full(vocab_size, float(concentration))
        # P[s, b] = P(next = b | context s); context s = (a1..ak) as base-V digits, a1 first.
        self.transitions = rng.dirichlet(alpha, size=self.n_states)  # (S, V)
        self._cum_rows: list[list[float]] | None = None
        # Eager, so a chain too degenerate to have a usable floor fails at construction.
        self._stationary = self._power_iteration()

    def stationary(self) -> np.ndarray:
        """Stationary distribution ``pi`` over the ``V**k`` contexts, shape (S,)."""
        return self._stationary

    def advance(self, pi: np.ndarray) -> np.ndarray:
        """One step of the context chain: (a1..ak) -> (a2..ak, b) with prob P(b | a1..ak)."""
        V = self.vocab_size
        flow = pi[:, None] * self.transitions  # (S, V): mass moving from s via token b
        # s = a1 * V**(k-1) + rest, and the next state is rest * V + b: summing the flow
        # over a1 lands it on the right successor without building an S x S matrix.
        return flow.reshape(V, self.n_states // V, V).sum(axis=0).reshape(-1)  # (S,)

    def _power_iteration(self, tol: float = 1e-12, max_iters: int = 100_000) -> np.ndarray:
        pi = np.full(self.n_states, 1.0 / self.n_states)
        for _ in range(max_iters):
            # The lazy chain (stay with prob 1/2) has the same stationary distribution but
            # is aperiodic, so the iteration converges even if the sparse chain cycles.
            nxt = 0.5 * (pi + self.advance(pi))
            nxt /= nxt.sum()
            if np.abs(nxt - pi).sum() < tol:
                return nxt
            pi = nxt
        # Only near-deterministic chains get here: some contexts leak to others with
        # probabilities like 1e-30, so mixing takes longer than any sequence we would draw.
        raise ValueError(
            f"MarkovSource(vocab_size={self.vocab_size}, order={self.order}, "
            f"concentration={self.concentration}, seed={self.seed}) mixes too slowly for its "
            f"stationary distribution to converge in {max_iters} steps; raise concentration "
            f"(0.01 or more is safe)"
        )

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats/token: ``sum_s pi(s) * H(P(. | s))``."""
        return float(self.stationary() @ _entropy(self.transitions))

    def block_entropy(self, m: int) -> float:
        """Entropy in nats of ``m`` consecutive tokens of the stationary chain, ``m <= order``."""
        if not 0 <= m <= self.order:
            raise ValueError(f"block_entropy needs 0 <= m <= order ({self.order}), got {m}")
        if m == 0:
            return 0.0
        # pi over (a1..ak); a window of m tokens is the marginal of the last m of them.
        joint = self.stationary().reshape((self.vocab_size,) * self.order)
        lead = tuple(range(self.order - m))
        return float(_entropy(joint.sum(axis=lead).reshape(-1)))

    def window_floor(self, seq_len: int) -> float:
        """Best achievable mean loss over a window predicting ``seq_len`` next tokens.

        Position t is predicted from t+1 tokens of context. Once t+1 >= order the floor is
        the entropy rate; before that it is ``H(X_{t+1} | X_0..X_t) = H_{t+2} - H_{t+1}``
        (block entropies). For order 2 only the first position pays extra.
        """
        if seq_len < 1:
            raise ValueError(f"window_floor needs seq_len >= 1, got {seq_len}")
        short = min(self.order - 1, seq_len)  # positions with less than `order` context
        total = sum(self.block_entropy(t + 2) - self.block_entropy(t + 1) for t in range(short))
        return (total + (seq_len - short) * self.entropy_rate()) / seq_len

    def _cumulative_rows(self) -> list[list[float]]:
        # Python lists + bisect beat numpy per-step calls in the inherently serial sampler.
        if self._cum_rows is None:
            cum = np.cumsum(self.transitions, axis=1)
            cum /= cum[:, -1:]  # so a uniform draw in [0, 1) always lands in the row
            self._cum_rows = cum.tolist()
        return self._cum_rows

    def generate(self, n_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """``n_tokens`` tokens (int64) of the chain, started from a context drawn from ``pi``.

        Starting in the stationary distribution makes every position of the sequence
        distributed as in the long run, so the loss floor is ``window_floor``, not the
        transient of an arbitrary start.
        """
        if n_tokens < 0:
            raise ValueError(f"generate needs n_tokens >= 0, got {n_tokens}")
        V, k = self.vocab_size, self.order
        cum_pi = np.cumsum(self.stationary())
        s = min(int(np.searchsorted(cum_pi, rng.random() * cum_pi[-1], side="right")),
                self.n_states - 1)
        context = [(s // V ** (k - 1 - j)) % V for j in range(k)]  # digits a1..ak
        out = np.empty(n_tokens, dtype=np.int64)
        m = min(k, n_tokens)
        out[:m] = context[:m]
        rows = self._cumulative_rows()
        mod = V ** (k - 1)
        u = rng.random(max(n_tokens - k, 0)).tolist()
        for i, ui in enumerate(u):
            b = min(bisect.bisect_right(rows[s], ui), V - 1)
            out[k + i] = b
            s = (s % mod) * V + b
        return out

    def log_prob(self, tokens: np.ndarray) -> np.ndarray:
        """``log P(tokens[t] | tokens[t-k:t])`` for t >= order, shape (len - order,)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        k, V = self.order, self.vocab_size
        n = len(tokens) - k
        if n <= 0:
            return np.empty(0)
        state = np.zeros(n, dtype=np.int64)
        for j in range(k):  # context of position t is tokens[t-k..t-1]
            state = state * V + tokens[j : j + n]
        with np.errstate(divide="ignore"):
            return np.log(self.transitions[state, tokens[k:]])


class TokenDataset(Protocol):
    """What the trainer needs from a dataset; ``__getitem__`` is deterministic in ``i``."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def entropy_floor(self) -> float | None: ...

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class SyntheticDataset:
    """``num_samples`` windows of a ``MarkovSource``; sample ``i`` is a pure function of (seed, i).

    Each sample draws from ``np.random.default_rng([seed, i])``, so any rank can build any
    sample on its own and two runs agree whatever the world size or access order.
    """

    def __init__(self, source: MarkovSource, num_samples: int, seq_len: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"SyntheticDataset.num_samples must be >= 1, got {num_samples}")
        if seq_len < 1:
            raise ValueError(f"SyntheticDataset.seq_len must be >= 1, got {seq_len}")
        self.source = source
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    @property
    def entropy_floor(self) -> float:
        """Best achievable mean loss per token on these windows (see ``window_floor``)."""
        return self.source.window_floor(self.seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = check_index(i, self.num_samples)
        rng = np.random.default_rng([self.seed, i])
        return next_token_pair(torch.from_numpy(self.source.generate(self.seq_len + 1, rng)))  # (T,), (T,)


class ByteFileDataset(NaturalText):
    """Byte-level tokens (vocab 256) of a file, cut into non-overlapping windows.

    Window ``i`` is bytes ``[i*(T+1), (i+1)*(T+1))``; the tail shorter than a window is
    dropped.
    """

    def __init__(self, path: str | Path, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"ByteFileDataset.seq_len must be >= 1, got {seq_len}")
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"data file {str(path)!r} does not exist or is not a file; "
                f"pass the path of a text file, or omit data_path to use synthetic data"
            )
        raw = path.read_bytes()
        window = seq_len + 1
        n = len(raw) // window
        if n == 0:
            raise ValueError(
                f"data file {str(path)!r} has {len(raw)} bytes, fewer than one window of "
                f"seq_len + 1 = {window} bytes; use a longer file or a smaller seq_len"
            )
        self.path = path
        self.seq_len = seq_len
        self._vocab = 256
        data = np.frombuffer(raw, dtype=np.uint8, count=n * window)
        self._windows = torch.from_numpy(data.astype(np.int64).reshape(n, window))  # (N, T+1)

    def __len__(self) -> int:
        return self._windows.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return next_token_pair(self._windows[check_index(i, len(self))])  # (T,), (T,)


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hash (seed, epoch) rather than add them, so (seed=0, epoch=1) and (seed=1, epoch=0)
    # give unrelated permutations. 63 bits keeps torch.Generator.manual_seed happy.
    words = np.random.SeedSequence([seed, epoch]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


class GlobalBatchSampler:
    """Deterministic, resumable sampler whose global batches ignore the world size.

    Each epoch is a permutation of ``range(num_samples)`` from a ``torch.Generator``
    seeded by a hash of (seed, epoch). Global batch ``step`` is
    ``perm[step * global_batch : (step + 1) * global_batch]`` and rank ``r`` takes the
    contiguous slice ``[r * B, (r + 1) * B)`` with ``B = global_batch // world``. A
    1-process run therefore sees the concatenation of all ranks' batches, in rank order.

    The last partial global batch of an epoch is dropped, identically on every rank, so
    every step has exactly ``global_batch`` samples and all ranks take the same number of
    steps (a rank with fewer steps would hang the others in a collective).

    ``state_dict()`` is in global terms (epoch, step), so a checkpoint can resume at a
    different world size and still see the same global batches.

    ``skip`` holds global batches, as (epoch, index in the epoch), that are passed over when they come
    up: the data window a spike rollback left out (zeroshard/trainer/heal.py). It is saved with the
    state, so a resumed run leaves them out too, and a rerun given them sees the same batches.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        *,
        world: int = 1,
        rank: int = 0,
        seed: int = 0,
        start_epoch: int = 0,
    ) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if global_batch % world != 0:
            raise ValueError(
                f"global_batch ({global_batch}) must be divisible by world ({world}); "
                f"use a global_batch that is a multiple of {world}"
            )
        if num_samples < global_batch:
            raise ValueError(
                f"num_samples ({num_samples}) is smaller than global_batch ({global_batch}), "
                f"so an epoch has no full batch; use more samples or a smaller global_batch"
            )
        if start_epoch < 0:
            raise ValueError(f"start_epoch must be >= 0, got {start_epoch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.world = world
        self.rank = rank
        self.seed = seed
        self._epoch = start_epoch
        self._step = 0  # index of the next global batch within the epoch
        self._perm: list[int] | None = None
        self._perm_epoch = -1
        self.skip: set[tuple[int, int]] = set()

    @property
    def local_batch(self) -> int:
        """Samples per rank per step."""
        return self.global_batch // self.world

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    @property
    def epoch(self) -> int:
        """Epoch of the next batch ``next_indices`` will return."""
        return self._epoch

    @property
    def step(self) -> int:
        """Index within the epoch of the next batch ``next_indices`` will return."""
        return self._step

    def _permutation(self) -> list[int]:
        if self._perm_epoch != self._epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, self._epoch))
            self._perm = torch.randperm(self.num_samples, generator=g).tolist()
            self._perm_epoch = self._epoch
        assert self._perm is not None
        return self._perm

    def _advance(self) -> None:
        self._step += 1
        if self._step == self.steps_per_epoch:
            self._epoch += 1
            self._step = 0

    def _pass_skipped(self) -> None:
        while (self._epoch, self._step) in self.skip:
            self._advance()

    def global_indices(self) -> list[int]:
        """The whole global batch ``next_indices`` will slice next, without advancing (past a skipped one)."""
        self._pass_skipped()
        start = self._step * self.global_batch
        return self._permutation()[start : start + self.global_batch]

    def next_indices(self) -> list[int]:
        """This rank's sample indices for the next step; rolls into the next epoch."""
        lo = self.rank * self.local_batch
        out = self.global_indices()[lo : lo + self.local_batch]
        self._advance()
        return out

    def skip_next(self) -> tuple[int, int, list[int]]:
        """Pass over the next global batch and keep it skipped: (epoch, index, its sample indices)."""
        samples = self.global_indices()
        where = (self._epoch, self._step)
        self.skip.add(where)
        self._advance()
        return where[0], where[1], samples

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seed": self.seed,
            "epoch": self._epoch,
            "step": self._step,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
        }
        if self.skip:
            out["skip"] = [list(p) for p in sorted(self.skip)]
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue exactly where ``sd`` left off; world and rank may differ, batches may not."""
        missing = sorted({"seed", "epoch", "step", "global_batch", "num_samples"} - set(sd))
        if missing:
            raise ValueError(f"sampler state_dict is missing keys {missing}")
        if sd["num_samples"] != self.num_samples:
            raise ValueError(
                f"sampler state was saved for num_samples={sd['num_samples']} but this dataset "
                f"has {self.num_samples}; resume with the same dataset"
            )
        if sd["global_batch"] != self.global_batch:
            raise ValueError(
                f"sampler state was saved with global_batch={sd['global_batch']} but this run "
                f"uses {self.global_batch}; keep the global batch when resuming (the world "
                f"size may change, the global batch may not)"
            )
        if not (0 <= sd["step"] < self.steps_per_epoch and sd["epoch"] >= 0):
            raise ValueError(
                f"sampler state has epoch={sd['epoch']}, step={sd['step']}, outside "
                f"[0, {self.steps_per_epoch}) steps per epoch; the state_dict is corrupt"
            )
        # The saved seed wins: resuming means continuing the saved stream.
        self.seed = int(sd["seed"])
        self._epoch = int(sd["epoch"])
        self._step = int(sd["step"])
        self._perm_epoch = -1
        self.skip |= {(int(e), int(i)) for e, i in sd.get("skip", [])}


def collate(dataset: TokenDataset, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into ``(B, T)`` inputs and targets."""
    if len(indices) == 0:
        raise ValueError("collate needs at least one index")
    xs, ys = zip(*(dataset[i] for i in indices))
    return torch.stack(xs), torch.stack(ys)  # (B, T), (B, T)


def build_dataset(
    *,
    data_path: str | Path | None = None,
    seq_len: int,
    num_samples: int = 4096,
    vocab_size: int = 64,
    order: int = 2,
    seed: int = 0,
    tokenizer: str | None = None,
    packing: str = "on",
    doc_mask: bool = False,
) -> Any:
    """Record files (JSONL, JSON, Parquet, Arrow: text, chat or prompt/completion, tokenized with
    ``tokenizer``'s folder and packed or padded, ``zeroshard.trainer.data_pack``), token windows of a
    folder of token files (``zeroshard.trainer.data_tokens``; with ``doc_mask`` attention stops at each
    EOS), byte-level windows of a text file, or, without ``data_path``, a synthetic Markov dataset.

    ``num_samples``, ``vocab_size``, ``order`` and ``seed`` only apply to synthetic data.
    """
    if data_path is not None:
        from zeroshard.trainer.data_pack import document_windows, record_dataset
        from zeroshard.trainer.data_records import is_record_path
        from zeroshard.trainer.data_tokens import TokenFileDataset, is_token_dir

        if is_record_path(data_path):
            return record_dataset(str(data_path), tokenizer, seq_len, packing=packing == "on")
        if is_token_dir(data_path):
            windows = TokenFileDataset(data_path, seq_len)
            return document_windows(windows) if doc_mask else windows
        if doc_mask:
            raise ValueError(f"doc_mask needs a token folder from `zeroshard data prepare`, not the text file "
                             f"{str(data_path)!r}; prepare it first, or drop --doc-mask")
        return ByteFileDataset(data_path, seq_len)
    source = MarkovSource(vocab_size=vocab_size, order=order, seed=seed)
    return SyntheticDataset(source, num_samples, seq_len, seed)


def data_tokenizer(model: str, tokenizer: str | None) -> str | None:
    """The tokenizer folder record data is read with: ``tokenizer``, else the model's folder (one
    save_pretrained wrote: it has a config.json), else None."""
    if tokenizer is not None:
        return tokenizer
    return model if (Path(model) / "config.json").is_file() else None


def check_data_path(path: str | None, seq_len: int, tokenizer: str | None) -> None:
    """What the launcher checks of a data path before any rank starts, so a mistake is one line and
    no run directory is made: a token folder opens, record data exists and has a tokenizer."""
    if path is None:
        return
    from zeroshard.trainer.data_records import is_record_path, load_chat_tokenizer
    from zeroshard.trainer.data_tokens import TokenFileDataset, is_token_dir

    if is_record_path(path):
        if not Path(path).exists():
            raise ValueError(f"data {path!r} does not exist; pass a .jsonl, .json, .parquet or .arrow file")
        if tokenizer is None:
            raise ValueError(f"data {path!r} holds records, which need a tokenizer: pass --model DIR (a folder saved "
                             f"with its tokenizer) or --tokenizer DIR")
        load_chat_tokenizer(tokenizer)
    elif is_token_dir(path):
        TokenFileDataset(path, seq_len)
