"""A built-in text corpus that needs no download: the Python standard library's own source.

The corpus is the bytes of the ``*.py`` files under the standard library
directory (``os.path.dirname(os.__file__)``, without ``site-packages`` or
``dist-packages``), read in sorted order of their relative paths and cut at
``max_chars`` bytes. Tokens are bytes, so the vocabulary has 256 entries and
needs no tokenizer. Whole files go either to the ``"train"`` or to the
``"heldout"`` split: in reading order, a file is held out when the held-out
bytes, with it, stay within ``heldout_fraction`` (default 10%) of all bytes
read so far, itself included. So the held-out files are spread over the whole
corpus, the splits are disjoint, and a larger ``max_chars`` only appends to
them (the first files keep their split).

The corpus is deterministic for a given Python installation (another Python
version has other standard-library sources and gives another corpus).

>>> from jpipe import data
>>> corpus = data.load(max_chars=200_000)
>>> corpus.vocab_size
256
>>> batch = next(corpus.batches(seq_len=16, batch_size=4, seed=0))
>>> batch["tokens"].shape, batch["tokens"].dtype
((4, 16), dtype('int32'))
>>> bool((batch["tokens"][:, 1:] == batch["targets"][:, :-1]).all())
True
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator

import numpy as np

__all__ = ["DEFAULT_MAX_CHARS", "VOCAB_SIZE", "Corpus", "batches", "decode", "encode", "load", "stdlib_dir"]

VOCAB_SIZE = 256
DEFAULT_MAX_CHARS = 3_000_000
SPLITS = ("train", "heldout")
DEFAULT_HELDOUT_FRACTION = 0.1
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> str:
    """The directory of the Python standard library's sources."""
    return os.path.dirname(os.__file__)


def _source_files(root: str) -> list[str]:
    """Relative paths of the ``*.py`` files under ``root``, sorted."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                paths.append(os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/"))
    return sorted(paths)


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as token ids (int32).

    >>> encode("hi").tolist()
    [104, 105]
    """
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Token ids (bytes) back to text; invalid UTF-8 is replaced.

    >>> decode(encode("def f(): pass"))
    'def f(): pass'
    """
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Byte-level text in two disjoint splits, ``train`` and ``heldout`` (``uint8`` arrays)."""

    train: np.ndarray
    heldout: np.ndarray
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    vocab_size: int = VOCAB_SIZE

    def split(self, name: str) -> np.ndarray:
        """The bytes of split ``name`` (``"train"`` or ``"heldout"``)."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return self.train if name == "train" else self.heldout

    def __len__(self) -> int:
        return len(self.train) + len(self.heldout)

    def unigram_entropy(self, split: str = "train") -> float:
        """Entropy (nats per byte) of the byte frequencies of ``split``.

        >>> corpus = load(max_chars=200_000)
        >>> 2.5 < corpus.unigram_entropy() < 4.0
        True
        """
        counts = np.bincount(self.split(split), minlength=self.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def unigram_loss(self) -> float:
        """The loss of predicting character frequencies: the mean cross-entropy (nats per byte) of
        the held-out bytes under the training split's byte frequencies (add-one-half smoothed).

        A language model that learned anything beyond how often each byte occurs has a
        held-out loss below this.

        >>> corpus = load(max_chars=200_000)
        >>> corpus.unigram_loss() >= corpus.unigram_entropy("heldout")
        True
        """
        counts = np.bincount(self.train, minlength=self.vocab_size) + 0.5
        log_q = np.log(counts / counts.sum())
        held = np.bincount(self.heldout, minlength=self.vocab_size)
        return float(-(held * log_q).sum() / held.sum())

    def batches(
        self,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        split: str = "train",
        num_batches: int | None = None,
    ) -> Iterator[dict[str, np.ndarray]]:
        """Random windows of ``split``: ``{"tokens": int32[b, T], "targets": int32[b, T]}``.

        Each row is a window of ``seq_len + 1`` consecutive bytes starting at a
        position drawn uniformly with ``numpy.random.default_rng(seed)``;
        ``targets`` is ``tokens`` shifted by one. Endless unless ``num_batches``
        is given; the same arguments give the same batches.
        """
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        text = self.split(split)
        if len(text) < seq_len + 1:
            raise ValueError(f"the {split!r} split has {len(text)} bytes, fewer than seq_len + 1 = "
                             f"{seq_len + 1}; use a shorter seq_len or a larger max_chars")
        rng = np.random.default_rng(seed)
        offsets = np.arange(seq_len + 1)
        produced = 0
        while num_batches is None or produced < num_batches:
            starts = rng.integers(0, len(text) - seq_len, size=batch_size)
            windows = text[starts[:, None] + offsets].astype(np.int32)
            yield {"tokens": windows[:, :-1], "targets": windows[:, 1:]}
            produced += 1


@functools.lru_cache(maxsize=4)
def load(
    max_chars: int = DEFAULT_MAX_CHARS,
    root: str | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
) -> Corpus:
    """The standard-library corpus: the first ``max_chars`` bytes of its sorted ``*.py`` files.

    ``root`` defaults to :func:`stdlib_dir`. Results are cached.

    >>> corpus = load(max_chars=300_000)
    >>> len(corpus)
    300000
    >>> set(corpus.train_files).isdisjoint(corpus.heldout_files)
    True
    """
    if not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"max_chars must be a positive int, got {max_chars!r}")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    root = stdlib_dir() if root is None else root
    parts: dict[str, list[bytes]] = {"train": [], "heldout": []}
    files: dict[str, list[str]] = {"train": [], "heldout": []}
    total = heldout = 0
    for rel in _source_files(root):
        if total >= max_chars:
            break
        with open(os.path.join(root, rel), "rb") as f:
            content = f.read(max_chars - total)
        if not content:
            continue
        total += len(content)
        split = "heldout" if heldout + len(content) <= heldout_fraction * total else "train"
        if split == "heldout":
            heldout += len(content)
        parts[split].append(content)
        files[split].append(rel)
    for split in SPLITS:
        if not parts[split]:
            raise ValueError(f"the corpus under {root} with max_chars={max_chars} has no {split!r} "
                             f"files; use a larger max_chars")

    def as_array(chunks: list[bytes]) -> np.ndarray:
        array = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        array.flags.writeable = False  # shared through the cache
        return array

    return Corpus(as_array(parts["train"]), as_array(parts["heldout"]),
                  tuple(files["train"]), tuple(files["heldout"]))


def batches(
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    split: str = "train",
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    num_batches: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of the standard-library corpus; see :meth:`Corpus.batches`.

    >>> it = batches(seq_len=8, batch_size=2, seed=1, split="heldout", max_chars=200_000)
    >>> b = next(it)
    >>> sorted(b), b["targets"].shape
    (['targets', 'tokens'], (2, 8))
    """
    return load(max_chars).batches(seq_len, batch_size, seed=seed, split=split, num_batches=num_batches)
