"""Training data: a built-in corpus that needs no download, a byte-level tokenizer, disjoint
per-rank slices, a held-out split, and a resumable read position.

The built-in corpus is the source of Python's own standard library (every ``*.py`` under
``sysconfig``'s stdlib path, without site-packages and the test suites, in sorted path order):
about 11 MB of text on every machine that runs Python. It is tokenized at byte level
(vocabulary 256), so no tokenizer download either. A user's data comes with ``--data PATH``:
a text file (bytes), a ``.npy`` array of token ids, or a raw ``.bin`` array (uint16 by default,
the nanoGPT format).

Layout of the token stream of N tokens:

    [ train: N - n_eval tokens                      | held-out: n_eval tokens ]
    [ slice 0 | slice 1 | ... | slice D-1 ]           [ e0 | e1 | ... | eD-1 ]

Every data-parallel rank d (D of them, all ranks of all federation groups) reads only slice d;
a slice is cut into windows of ``seq_len + 1`` tokens, read in a permuted order that depends on
(seed, d, epoch) only, so the stream is deterministic and resumes from one integer (windows
consumed).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

BUILTIN_CORPUS = "python-stdlib"
BYTE_VOCAB = 256

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__",
                        "lib2to3", "turtledemo", "ensurepip", "venv"})


def encode(text: str) -> np.ndarray:
    """Byte-level tokenizer: the UTF-8 bytes of ``text`` as uint8 token ids."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: np.ndarray | Tensor | list[int]) -> str:
    """Inverse of :func:`encode` (invalid UTF-8 sequences become U+FFFD)."""
    if isinstance(tokens, Tensor):
        tokens = tokens.cpu().numpy()
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def builtin_files() -> list[str]:
    """The files of the built-in corpus, in the order they are concatenated."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def builtin_corpus(max_bytes: int | None = None) -> np.ndarray:
    """The built-in corpus as byte tokens (uint8), files separated by a blank line.

    Raises RuntimeError when the stdlib sources are not installed (e.g. a stripped image): pass
    ``--data PATH`` there.
    """
    chunks: list[bytes] = []
    total = 0
    for path in builtin_files():
        with open(path, "rb") as f:
            b = f.read() + b"\n\n"
        chunks.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    if total < 1 << 16:
        raise RuntimeError(f"the built-in corpus (Python stdlib sources under "
                           f"{sysconfig.get_paths()['stdlib']}) has only {total} bytes; give a "
                           "dataset with --data PATH")
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return data[:max_bytes] if max_bytes is not None else data


def load_tokens(path: str | None = None, dtype: str | None = None, max_tokens: int | None = None) -> np.ndarray:
    """Token ids of a dataset, as a 1-D integer array (memory-mapped for .npy / .bin).

    Args:
        path: None for the built-in corpus; a ``.npy`` file (1-D integer array); a ``.bin`` file
            (raw integers of ``dtype``, default uint16); anything else is read as text, byte level.
        dtype: element type of a ``.bin`` file (e.g. "uint16", "uint32", "int32").
        max_tokens: keep only the first ``max_tokens`` tokens.
    """
    if path is None:
        return builtin_corpus(max_tokens)
    src = f"--data {path!r}"
    if os.path.isdir(path):
        raise ValueError(f"{src} is a directory; expected a text, .npy or .bin file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{src}: no such file")
    try:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            if arr.ndim != 1:
                raise ValueError(f"{src} holds an array of shape {arr.shape}; expected a 1-D array of token ids "
                                 "(one stream: save arr.reshape(-1) if its rows follow one another)")
        elif path.endswith(".bin"):
            dt = np.dtype(dtype or "uint16")
            size = os.path.getsize(path)
            if size % dt.itemsize:
                raise ValueError(f"{src} has {size} bytes, not a whole number of {dt} token ids "
                                 f"({dt.itemsize} bytes each); give the right --data-dtype")
            arr = np.memmap(path, dtype=dt, mode="r")
        else:
            with open(path, "rb") as f:
                arr = np.frombuffer(f.read(), dtype=np.uint8)
    except (TypeError, ValueError, OSError) as e:
        if str(e).startswith(src):
            raise
        raise ValueError(f"{src} cannot be read as token ids: {e}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{src}: token ids must be integers, got dtype {arr.dtype}")
    if len(arr) == 0:
        raise ValueError(f"{src} holds no tokens")
    return arr[:max_tokens] if max_tokens is not None else arr


def data_source(path: str | None) -> str:
    """How messages name a dataset."""
    return f"--data {path!r}" if path is not None else f"the built-in corpus ({BUILTIN_CORPUS})"


_RECORD_BYTES = 1 << 20


def data_record(path: str | None, tokens: np.ndarray) -> dict:
    """What a checkpoint records about the data ``tokens`` (as :func:`load_tokens` read them
    from ``path``), to refuse a resume on other data: the source (absolute path or the
    built-in corpus), the number and type of tokens used, and a hash of their first and last
    MB."""
    raw = np.ascontiguousarray(tokens[: _RECORD_BYTES // tokens.itemsize]).view(np.uint8)
    tail = np.ascontiguousarray(tokens[max(0, len(tokens) - _RECORD_BYTES // tokens.itemsize):]).view(np.uint8)
    return {"source": os.path.abspath(path) if path is not None else BUILTIN_CORPUS,
            "tokens": int(len(tokens)), "dtype": str(tokens.dtype),
            "file_bytes": os.path.getsize(path) if path is not None else None,
            "head_blake2b": hashlib.blake2b(raw.data, digest_size=16).hexdigest(),
            "tail_blake2b": hashlib.blake2b(tail.data, digest_size=16).hexdigest()}


def same_data(a: dict, b: dict) -> bool:
    """Whether two :func:`data_record` s describe the same token stream (the path may differ)."""
    keys = ("tokens", "dtype", "head_blake2b", "tail_blake2b")
    return all(a.get(k) == b.get(k) for k in keys)


_FINGERPRINT_FULL = 1 << 25


def fingerprint(tokens: np.ndarray) -> int:
    """A 63-bit hash of the token stream (ranks compare it to be sure they read the same data).

    Streams up to 32 M tokens are hashed whole; longer ones by their length, dtype, first and
    last 16 M tokens and 4096 tokens sampled at a fixed stride.
    """
    # NOTE: every rank computes this at start-up: reading a multi-GB memory-mapped dataset in
    # full on every rank would cost minutes; a sample catches the realistic mismatch (another
    # file or another version of it).
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{tokens.dtype}:{len(tokens)}".encode())
    n, half = len(tokens), _FINGERPRINT_FULL // 2
    parts = [tokens] if n <= _FINGERPRINT_FULL else [tokens[:half], tokens[n - half:],
                                                      tokens[:: max(1, n // 4096)]]
    for part in parts:
        h.update(np.ascontiguousarray(part).view(np.uint8).data)
    return int.from_bytes(h.digest(), "little") >> 1


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str, limit: int = 1 << 28) -> None:
    """Refuse token ids the model's embedding cannot index, negative or ``>= vocab_size`` (a
    clear error instead of an index error, or a device-side assert on a GPU, in the first
    forward). Longer streams are checked on their first ``limit`` tokens."""
    head = tokens[:limit]
    if not len(head):
        return
    lo, hi = int(head.min()), int(head.max())
    if lo < 0:
        raise ValueError(f"{source} has a negative token id ({lo}); token ids must be in [0, vocab_size)")
    if hi >= vocab_size:
        raise ValueError(f"{source} has token id {hi}, beyond the model's vocabulary of {vocab_size}; "
                         f"pass --vocab-size {hi + 1} or more")


@dataclass(frozen=True)
class Split:
    """The train and held-out parts of a token stream."""

    train: np.ndarray
    heldout: np.ndarray


def split_tokens(tokens: np.ndarray, eval_fraction: float = 0.02, min_eval_tokens: int = 0) -> Split:
    """Hold out the last ``max(eval_fraction * N, min_eval_tokens)`` tokens for evaluation."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(tokens)
    n_eval = max(int(n * eval_fraction), min_eval_tokens)
    if n_eval >= n:
        raise ValueError(f"dataset of {n} tokens is too small to hold out {n_eval} for evaluation")
    return Split(tokens[: n - n_eval], tokens[n - n_eval:])


def slice_bounds(n: int, num_slices: int, index: int) -> tuple[int, int]:
    """[start, end) of slice ``index`` of ``num_slices`` equal contiguous slices of ``n`` tokens."""
    if not 0 <= index < num_slices:
        raise ValueError(f"slice index must be in [0, {num_slices}), got {index}")
    per = n // num_slices
    return index * per, (index + 1) * per


def check_slices(n: int, num_slices: int, seq_len: int) -> None:
    """ValueError unless each of ``num_slices`` equal slices of ``n`` train tokens holds one
    window of ``seq_len + 1`` tokens (checked before launch, and by the loader again)."""
    per = n // num_slices
    if per < seq_len + 1:
        raise ValueError(f"each of the {num_slices} data slices has {per} tokens, fewer than one window of "
                         f"seq_len + 1 = {seq_len + 1}; use a bigger dataset, a shorter --seq-len or fewer ranks")


def split_for_ranks(tokens: np.ndarray, num_slices: int, batch_size: int, seq_len: int,
                    eval_fraction: float) -> Split:
    """The train / held-out split of ``tokens`` for ``num_slices`` ranks (a held-out batch per
    rank at least), each rank's train slice checked to hold a window (:func:`check_slices`)."""
    split = split_tokens(tokens, eval_fraction, num_slices * batch_size * (seq_len + 1) + num_slices)
    check_slices(len(split.train), num_slices, seq_len)
    return split


class ShardedLoader:
    """Batches of ``[batch_size, seq_len]`` inputs and next-token targets from one slice.

    Algorithm:
      1. the train tokens are cut into ``num_slices`` equal contiguous slices; this loader reads
         slice ``slice_index`` only (disjoint from every other rank's);
      2. the slice holds ``n_windows = (len - 1) // seq_len`` windows; window j is tokens
         ``[j seq_len, j seq_len + seq_len + 1)`` (input = first seq_len, target = last seq_len);
      3. epoch e reads the windows in the order of a permutation drawn from (seed, slice, e);
      4. ``position`` counts windows consumed; it is the whole resumable state.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, num_slices: int = 1,
                 slice_index: int = 0, seed: int = 0, shuffle: bool = True,
                 device: torch.device | str = "cpu") -> None:
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        start, end = slice_bounds(len(tokens), num_slices, slice_index)
        self.tokens = tokens[start:end]
        self.start, self.end = start, end
        self.seq_len, self.batch_size = seq_len, batch_size
        self.slice_index, self.seed, self.shuffle = slice_index, seed, shuffle
        self.device = torch.device(device)
        check_slices(len(tokens), num_slices, seq_len)
        self.n_windows = (len(self.tokens) - 1) // seq_len
        self.position = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.slice_index, epoch])
                self._perm = rng.permutation(self.n_windows)
            else:
                self._perm = np.arange(self.n_windows)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def window_indices(self, position: int, count: int) -> list[int]:
        """Which windows (indices into the slice) positions ``position ..`` read."""
        out = []
        for w in range(position, position + count):
            out.append(int(self._order(w // self.n_windows)[w % self.n_windows]))
        return out

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """The next (inputs, targets), each int64 [batch_size, seq_len]; advances ``position``."""
        T = self.seq_len
        rows = [np.asarray(self.tokens[j * T: j * T + T + 1], dtype=np.int64)
                for j in self.window_indices(self.position, self.batch_size)]
        self.position += self.batch_size
        b = torch.from_numpy(np.stack(rows))
        if self.device.type != "cpu":
            b = b.pin_memory().to(self.device, non_blocking=True)
        return b[:, :-1], b[:, 1:]

    @property
    def epoch(self) -> float:
        return self.position / self.n_windows

    def state_dict(self) -> dict:
        return {"position": self.position, "slice_index": self.slice_index, "seed": self.seed,
                "n_windows": self.n_windows}

    def load_state_dict(self, sd: dict) -> None:
        for k in ("slice_index", "seed", "n_windows"):
            if k in sd and sd[k] != getattr(self, k):
                raise ValueError(f"data state is for {k}={sd[k]}, but this loader has "
                                 f"{k}={getattr(self, k)} (different topology, seed, dataset or "
                                 "seq_len)")
        self.position = int(sd["position"])


def eval_batches(heldout: np.ndarray, seq_len: int, batch_size: int, num_batches: int,
                 num_slices: int = 1, slice_index: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Up to ``num_batches`` fixed batches from slice ``slice_index`` of the held-out tokens
    (non-overlapping windows, in order). Every slice yields the same number of batches, so ranks
    that must run forward passes together (a shard group) stay in step."""
    start, end = slice_bounds(len(heldout), num_slices, slice_index)
    part = heldout[start:end]
    n_win = (len(part) - 1) // seq_len
    n_batches = min(num_batches, n_win // batch_size)
    if n_batches < 1:
        raise ValueError(f"held-out slice of {len(part)} tokens holds fewer than one batch of "
                         f"{batch_size} x {seq_len + 1} tokens; raise --eval-fraction or lower "
                         "--batch-size / --seq-len")
    out = []
    for b in range(n_batches):
        rows = [np.asarray(part[j * seq_len: j * seq_len + seq_len + 1], dtype=np.int64)
                for j in range(b * batch_size, (b + 1) * batch_size)]
        t = torch.from_numpy(np.stack(rows))
        out.append((t[:, :-1], t[:, 1:]))
    return out
