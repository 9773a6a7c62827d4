"""The demo's datasets: names on the command line -> the same global batches on every rank.

* ``stdlib`` (default): the Python standard library's source, one document per definition
  (see :mod:`megatron_bytescale.data.corpus` for why not whole files); ``stdlib-files``: one
  document per file.
* ``synthetic-rings``: a ring-heavy mix (:func:`ring_heavy_documents`), where HDP balance beats
  Alg. 1 on 4 ranks by about 10 %;
* ``synthetic-github`` / ``synthetic-byted``: lengths from :mod:`megatron_bytescale.data.synthetic`
  (the paper's GitHub / Byted statistics at a 2M context and C = 8K) scaled by
  ``capacity / 8192`` so that a sequence needs as many demo ranks as it would need 8K-token
  ranks in the paper, clipped to the demo's context; the tokens are random bytes (so their
  loss stays near ln 256: these datasets measure speed, not learning).
* a ``*.jsonl`` file: the ``"text"`` field of every line, as bytes.
* a Megatron indexed-dataset prefix (``PREFIX.bin`` + ``PREFIX.idx``): token ids as stored.

Every source is deterministic, so every rank builds identical global batches without talking.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from megatron_bytescale.data.corpus import BYTE_VOCAB_SIZE, jsonl_documents, stdlib_documents
from megatron_bytescale.data.global_batches import global_batches
from megatron_bytescale.data.hdp_iterator import GlobalBatch

from .demo_settings import DemoSettings

MAX_DEMO_VOCAB = 2**18
"""Most embedding rows of the CPU demo's model (262,144: every real tokenizer's vocabulary)."""
PAPER_CAPACITY = 8192  # tokens per rank in the paper's case study (312K on 39 ranks)


def synthetic_documents(name: str, settings: DemoSettings, *, seed: int) -> Iterator[np.ndarray]:
    """Random-byte documents whose lengths follow the paper's GitHub or Byted mix, scaled down."""
    from megatron_bytescale.data import synthetic

    generator = {"synthetic-github": synthetic.github, "synthetic-byted": synthetic.byted}[name]
    scale = settings.capacity / PAPER_CAPACITY
    rng = np.random.default_rng(seed)
    draw = 0
    while True:
        paper_lengths = generator(int(settings.tokens_per_step / scale), seed=seed + draw)
        draw += 1
        for length in paper_lengths:
            n = int(min(max(round(float(length) * scale), 2), settings.context_length))
            yield rng.integers(0, BYTE_VOCAB_SIZE, n, dtype=np.int64)


RING_FRACTION = 0.2
"""Share of ``synthetic-rings`` documents that need a ring of 3 ranks."""


def ring_heavy_documents(settings: DemoSettings, *, seed: int) -> Iterator[np.ndarray]:
    """Random-byte documents of a ring-heavy mix: :data:`RING_FRACTION` of them between 2C + 1
    and 1300 / 512 * C tokens (each on a ring of 3 ranks), the rest 200 / 512 * C to 400 / 512 * C
    tokens (one or two per pack). On 4 ranks Alg. 1 runs every ring on 3 ranks in its own time
    step and gives the fourth rank one pack, which takes about half as long, so the rings' ranks
    finish last; HDP balance moves packs off the ring ranks (the planner estimates about 10 %
    off naive's step at the demo's calibration, the most of the mixes searched; a gain the
    validation can measure on 4 CPU ranks)."""
    rng = np.random.default_rng(seed)
    c = settings.capacity
    long_lo = min(2 * c + 1, settings.context_length)
    long_hi = min(max(long_lo, round(1300 * c / 512)), settings.context_length)
    short_lo = max(8, round(200 * c / 512))
    short_hi = max(short_lo, round(400 * c / 512))
    while True:
        if rng.random() < RING_FRACTION and long_hi > c:
            n = int(rng.integers(long_lo, long_hi + 1))
        else:
            n = int(rng.integers(short_lo, short_hi + 1))
        yield rng.integers(0, BYTE_VOCAB_SIZE, n, dtype=np.int64)


def documents_for(name: str, settings: DemoSettings) -> tuple[Iterator[np.ndarray], str]:
    """The document stream of dataset ``name`` and a one-line description of it."""
    seed = settings.seed
    if name == "stdlib":
        return (
            stdlib_documents(unit="definition", seed=seed),
            "Python stdlib source, one document per def/class",
        )
    if name == "stdlib-files":
        return (
            stdlib_documents(unit="file", seed=seed),
            "Python stdlib source, one document per file",
        )
    if name in ("synthetic-github", "synthetic-byted"):
        return synthetic_documents(name, settings, seed=seed), (
            f"paper's {name.split('-')[1]} length mix scaled by C/{PAPER_CAPACITY}, random bytes"
        )
    if name == "synthetic-rings":
        return ring_heavy_documents(settings, seed=seed), (
            f"ring-heavy mix: {RING_FRACTION:.0%} of documents of 2C+1..1300 tokens (rings of 3), the "
            "rest 200..400 tokens (scaled by C/512), random bytes"
        )
    if name.endswith(".jsonl"):
        from megatron_bytescale.planner.inputs import check_regular_file

        check_regular_file(name, "--data jsonl file")  # a FIFO would block open() forever
        return jsonl_documents(name), f"jsonl file {name} (text field, bytes)"
    from megatron_bytescale.integration.indexed_tokens import indexed_documents, is_indexed_prefix

    if is_indexed_prefix(name):
        return indexed_documents(name), f"Megatron indexed dataset {name}"
    raise ValueError(
        f"--data {name!r} is neither a built-in dataset (stdlib, stdlib-files, synthetic-github, "
        "synthetic-byted, synthetic-rings), a .jsonl file, nor a Megatron indexed prefix (PREFIX.bin + PREFIX.idx)"
    )


def demo_global_batches(name: str, settings: DemoSettings) -> tuple[list[GlobalBatch], str]:
    """``settings.steps`` global batches of ``settings.tokens_per_step`` tokens each."""
    documents, description = documents_for(name, settings)
    batches = list(
        global_batches(
            documents,
            tokens_per_batch=settings.tokens_per_step,
            context_length=settings.context_length,
            max_batches=settings.steps,
        )
    )
    if len(batches) < settings.steps:
        raise ValueError(
            f"--data {name}: only {len(batches)} global batches of {settings.tokens_per_step} "
            f"tokens, {settings.steps} steps asked for"
        )
    highest = vocab_size_of(batches) - 1
    if highest >= MAX_DEMO_VOCAB:
        raise ValueError(
            f"--data {name}: token id {highest:,} is beyond the {MAX_DEMO_VOCAB:,} embedding rows the CPU "
            "demo builds; its model would not fit (a corrupt dataset, or one from another tokenizer)"
        )
    return batches, description


def vocab_size_of(batches: list[GlobalBatch]) -> int:
    """Byte vocabulary (256), or more when a dataset stores larger token ids."""
    highest = max(int(np.max(np.asarray(s))) for b in batches for s in b.tokens_by_seq)
    return max(BYTE_VOCAB_SIZE, highest + 1)
