"""The trainer's data (python -m distca.torch.train): every rank builds the whole step from the
seed or the file and takes its own slice.

Synthetic workloads (skewed, spanning, packed) of Markov text, a function of (seed, step) alone so
a resumed run sees the same batches; or a JSON lines file (a "text" per line, UTF-8 bytes as
tokens), read once into one buffer and packed in order into ranks x context tokens per step, a
document that overflows a rank continuing on the next.
"""
from __future__ import annotations

import array
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np


class DataError(ValueError):
    """A data file that cannot be trained on: one line naming file:line."""


@dataclass
class StepData:
    tokens: np.ndarray            # [R T] int64
    targets: np.ndarray           # [R T] int64: the next token of the same document, -1 at its end
    pieces: list                  # per rank: [(doc_key, begin, end, doc_length)] in row order
    num_targets: int              # over all ranks
    epoch_started: Optional[int] = None   # --data: a new pass over the file began in this step

    def spanning_documents(self) -> int:
        """How many documents have pieces on more than one rank."""
        ranks_of: dict = {}
        for rank, pieces in enumerate(self.pieces):
            for key, *_ in pieces:
                ranks_of.setdefault(key, set()).add(rank)
        return sum(len(r) > 1 for r in ranks_of.values())

    def rank_slice(self, rank: int, context: int) -> tuple:
        """(tokens, targets, pieces, cu_seqlens or None) of one rank; cu_seqlens when every piece
        there is a whole document."""
        rows = slice(rank * context, (rank + 1) * context)
        pieces = self.pieces[rank]
        whole = all(b == 0 and e == n for _, b, e, n in pieces)
        cu = np.concatenate([[0], np.cumsum([e - b for _, b, e, _ in pieces])]) if whole else None
        return self.tokens[rows], self.targets[rows], pieces, cu


def pack_documents(docs: list, num_ranks: int, context: int) -> StepData:
    """docs: (tokens, targets) arrays in order, filling num_ranks x context exactly -> StepData;
    a document that overflows a rank continues on the next (pieces of one doc_key)."""
    tokens = np.concatenate([t for t, _ in docs]).astype(np.int64)
    targets = np.concatenate([y for _, y in docs]).astype(np.int64)
    assert len(tokens) == num_ranks * context, (len(tokens), num_ranks, context)
    pieces: list = [[] for _ in range(num_ranks)]
    at = 0
    for key, (t, _) in enumerate(docs):
        n, begin = len(t), 0
        while begin < n:
            rank, offset = divmod(at, context)
            take = min(n - begin, context - offset)
            pieces[rank].append((key, begin, begin + take, n))
            begin += take
            at += take
    return StepData(tokens, targets, pieces, int((targets >= 0).sum()))


class MarkovText:
    """A fixed random Markov chain over 32 printable symbols: each is followed by one of 4 others
    with probabilities 0.55, 0.25, 0.15, 0.05 (about 1.1 nats per token): the C++ source's construction,
    not its table (the numbers differ from `distca train`'s)."""
    ALPHABET = b"abcdefghijklmnopqrstuvwxyz .,;!?"
    CUTS = np.array([0.55, 0.80, 0.95])

    def __init__(self):
        self.next = np.random.default_rng(0x5EED).integers(0, 32, size=(32, 4)).tolist()

    def document(self, n: int, rng: np.random.Generator) -> tuple:
        """n tokens and their targets (-1 at the end)."""
        picks = np.searchsorted(self.CUTS, rng.random(n), side="right").tolist()
        s, symbols, table = int(rng.integers(32)), [], self.next
        for p in picks:
            symbols.append(s)
            s = table[s][p]
        tokens = np.frombuffer(self.ALPHABET, dtype=np.uint8)[symbols].astype(np.int64)
        return tokens, np.append(tokens[1:], -1)


class SyntheticData:
    """Step k's batch is a function of (seed, k) alone, so a resumed run sees the same data."""

    def __init__(self, workload: str, seed: int, num_ranks: int, context: int):
        self.workload, self.seed, self.num_ranks, self.context = workload, seed, num_ranks, context
        self.text = MarkovText()

    def describe(self) -> str:
        what = {"skewed": "every other rank one whole document, the others short ones of 2..context/8",
                "spanning": "every other pair of ranks one document across both, the others short ones of 2..context/8",
                "packed": "documents of 2..2 x context tokens packed in order across ranks"}[self.workload]
        return f"synthetic {self.workload} (seed {self.seed}: {what}; Markov text)"

    def lengths(self, rng: np.random.Generator) -> list:
        t, out = self.context, []

        def short_documents(left: int) -> None:
            while left > 0:
                n = min(int(rng.integers(2, max(2, t // 8) + 1)), left)
                out.append(n)
                left -= n

        if self.workload == "skewed":
            for rank in range(self.num_ranks):
                if rank % 2 == 0:
                    out.append(t)
                else:
                    short_documents(t)
        elif self.workload == "spanning":   # pairs of ranks; one rank left over takes short documents
            for first in range(0, self.num_ranks, 2):
                if first % 4 == 0 and first + 1 < self.num_ranks:
                    out.append(2 * t)
                else:
                    short_documents(t * min(2, self.num_ranks - first))
        else:
            left = self.num_ranks * t
            while left > 0:
                n = min(int(rng.integers(2, 2 * t + 1)), left)
                out.append(n)
                left -= n
        return out

    def step(self, k: int) -> StepData:
        rng = np.random.default_rng([self.seed, k])
        docs = [self.text.document(n, rng) for n in self.lengths(rng)]
        return pack_documents(docs, self.num_ranks, self.context)


class Documents:
    """A file's documents as one uint8 buffer and their offsets: the file's bytes at most (a text's
    UTF-8 bytes never outnumber its line's) plus 8 bytes per document, however many there are."""

    def __init__(self, buffer: np.ndarray, offsets: np.ndarray, lines: np.ndarray):
        self.buffer, self.offsets, self.lines = buffer, offsets, lines   # offsets: (docs + 1) int64

    @classmethod
    def of(cls, docs: list) -> "Documents":
        """From a list of uint8 arrays (tests, small inputs)."""
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
        buffer = np.concatenate(docs).astype(np.uint8) if docs else np.zeros(0, np.uint8)
        return cls(buffer, offsets, np.arange(1, len(docs) + 1, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.buffer[self.offsets[i]:self.offsets[i + 1]]

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.offsets.nbytes + self.lines.nbytes

    def fingerprint(self) -> str:
        """The documents' identity from their content, as `distca train`'s (src/train/data.cc:
        their count and a hash of every document): the count, the bytes and a SHA-256 over every
        document's length and then all their bytes, so both the text and where each document ends
        count. Not the path: a moved file is the same data, a rewritten one is not."""
        digest = hashlib.sha256()
        digest.update(np.diff(self.offsets).astype("<i8").tobytes())
        digest.update(np.ascontiguousarray(self.buffer).data)
        n = len(self)
        return f"{n} document{'s' if n != 1 else ''}, {self.buffer.nbytes} bytes, sha256 {digest.hexdigest()[:16]}"


PROGRESS_SECONDS = 2.0


def read_jsonl(path: str, progress: Optional[Callable[[str], None]] = None) -> Documents:
    """Every non-blank line's "text" as UTF-8 bytes, read line by line into one buffer (memory: the
    file's size plus 16 bytes per document, and a few copies of the longest line while it is
    parsed); empty texts skipped. A bad line raises DataError
    naming file:line. progress: called with a line every 2 s when reading takes that long."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open the data file ({e.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        buffer = bytearray(size)
        view = memoryview(buffer)
        offsets, lines = array.array("q", [0]), array.array("q")
        at, start = 0, time.perf_counter()
        last = start
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
                raise DataError(f"{path}:{number}: not JSON ({msg})") from None
            except RecursionError:
                raise DataError(f"{path}:{number}: nested too deeply to be a document") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise DataError(f"{path}:{number}: expected an object with a \"text\" field")
            if not isinstance(obj["text"], str):
                raise DataError(f"{path}:{number}: \"text\" must be a string")
            data = obj["text"].encode("utf-8", errors="surrogatepass")
            if not data:
                continue
            if at + len(data) > len(buffer):      # the file grew while being read
                raise DataError(f"{path}: changed while being read (it grew past {size} bytes)")
            view[at:at + len(data)] = data
            at += len(data)
            offsets.append(at)
            lines.append(number)
            now = time.perf_counter()
            if progress is not None and now - last >= PROGRESS_SECONDS:
                last = now
                progress(f"reading {path}: {f.tell() / 2**20:.0f} of {size / 2**20:.0f} MiB, {len(lines)} documents "
                    f"[{now - start:.0f}s]")
    if not lines:
        raise DataError(f"{path}: no document (every line blank or with an empty text)")
    offsets_a = np.frombuffer(offsets, dtype=np.int64)
    if int(np.diff(offsets_a).max()) < 2:
        raise DataError(f"{path}: every document is one byte long, so no token has a next one to predict")
    view.release()
    return Documents(np.frombuffer(buffer, dtype=np.uint8)[:at], offsets_a, np.frombuffer(lines, dtype=np.int64))


class JsonlData:
    """The file's documents end to end, read as one stream that starts again at the top: step k
    covers stream tokens [k N, (k + 1) N), N = ranks x context. A document cut at a step's start
    continues as a new document (positions from 0); its last token before the cut still predicts
    the next one."""

    def __init__(self, path: str, docs: Union[Documents, list], num_ranks: int, context: int):
        self.path, self.num_ranks, self.context = path, num_ranks, context
        self.docs = docs if isinstance(docs, Documents) else Documents.of(docs)
        self.offsets = self.docs.offsets
        self.total = int(self.offsets[-1])
        self.fingerprint = self.docs.fingerprint()   # what a checkpoint names the data by

    def describe(self) -> str:
        return f"{self.path} ({len(self.docs)} documents, {self.total} tokens, JSON lines)"

    def step(self, k: int) -> StepData:
        n = self.num_ranks * self.context
        begin, end = k * n, (k + 1) * n
        docs, pos = [], begin
        while pos < end:
            r = pos % self.total
            i = int(np.searchsorted(self.offsets, r, side="right")) - 1
            doc = self.docs[i]
            start = r - int(self.offsets[i])
            take = min(len(doc) - start, end - pos)
            tokens = doc[start:start + take].astype(np.int64)
            following = doc[start + 1:start + take + 1]          # shorter by one where the document ends
            targets = np.full(take, -1, dtype=np.int64)
            targets[:len(following)] = following
            docs.append((tokens, targets))
            pos += take
        data = pack_documents(docs, self.num_ranks, self.context)
        if data.num_targets == 0:   # every token of the step ends its document
            first = int(np.searchsorted(self.offsets, begin % self.total, side="right")) - 1
            raise DataError(f"{self.path}:{int(self.docs.lines[first])}: step {k + 1} holds only one-byte documents "
                             f"(from this line on), so no token in it has a next one to predict")
        first_top = -(-begin // self.total) * self.total     # the first start of the file at or after begin
        data.epoch_started = first_top // self.total if 0 < first_top < end else None
        return data
