"""Global batches of documents for ``pretrain_gpt.py --bytescale-hdp``.

Megatron's GPT datasets cut a stream of concatenated documents into fixed ``--seq-length``
samples and give every data-parallel rank ``--micro-batch-size`` of them per micro-batch. HDP
plans *documents* instead: a short document stays whole on one rank, a long one gets a ring of
the ranks it needs. So under ``--bytescale-hdp`` the data comes from here:

* a :class:`DocumentSource` is a set of documents: their lengths (known up front, from the
  ``.idx`` file alone or from a seeded generator) and a reader for any token range of one
  document, used lazily: a rank only reads the tokens of the pieces its micro-batches hold;
* :func:`budget_batches` walks the documents in a seeded order (one permutation per epoch;
  a weighted ``--data-path`` blends the datasets by tokens, see
  :mod:`megatron_bytescale.data.document_order`), cuts a document longer than the context into
  context-length sequences (as a Megatron dataset splits long documents into samples), and
  fills each global batch with its token budget (the step's global batch size in Megatron's
  schedule, ramp-up included, x ``--seq-length``: the same token count per step as a
  Megatron run with the same flags); the sequence that would overflow a batch is cut and its
  remainder opens the next batch. The walk reads lengths only, so resuming at step k skips k
  batches without reading a token; without a weighted blend it does not even walk them
  (:mod:`megatron_bytescale.data.batch_seek` jumps a batch per binary search).

Every rank builds the same batches (same seed, same documents): the HDP planner then plans
each batch identically on every rank (DESIGN.md D7).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from megatron_bytescale.data.batch_seek import PoolCursor, seek_pool_batches
from megatron_bytescale.data.document_order import DocumentVisit, document_visits
from megatron_bytescale.data.hdp_iterator import GlobalBatch

from .batch_schedule import GlobalBatchSchedule
from .compat import evaluation_global_batch_size
from .config import ByteScaleConfig

logger = logging.getLogger(__name__)

#: A sequence needs two tokens to carry one next-token label.
MIN_TOKENS = 2


@dataclass(frozen=True, kw_only=True)
class DocumentSource:
    """Documents: ``lengths[d]`` tokens each, and ``read(d, start, length)`` for their tokens.

    ``datasets`` holds where each dataset's documents start, plus the end (one dataset, all
    documents, when empty); ``dataset_names`` names them (for blends and messages).
    """

    name: str
    lengths: np.ndarray
    read: Callable[[int, int, int], np.ndarray]
    datasets: tuple[int, ...] = ()
    dataset_names: tuple[str, ...] = ()

    @property
    def dataset_bounds(self) -> tuple[int, ...]:
        return self.datasets or (0, len(self.lengths))

    @property
    def num_documents(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Tokens ``[start, start + length)`` of document ``doc``: one sequence of a global batch,
    visited in ``epoch`` of its dataset (``dataset``)."""

    doc: int
    start: int
    length: int
    epoch: int = 0
    dataset: int = 0


class PieceTokens(Sequence):
    """The tokens of a global batch's sequences, read from the source only when asked for."""

    def __init__(self, source: DocumentSource, pieces: Sequence[Piece]) -> None:
        self._source = source
        self._pieces = tuple(pieces)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Which document range each sequence of the batch is."""
        return self._pieces

    def __len__(self) -> int:
        return len(self._pieces)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        piece = self._pieces[index]
        tokens = np.asarray(self._source.read(piece.doc, piece.start, piece.length))
        if len(tokens) != piece.length:
            raise ValueError(
                f"{self._source.name}: document {piece.doc} returned {len(tokens)} tokens for "
                f"[{piece.start}, {piece.start + piece.length}); is the .bin file truncated?"
            )
        return tokens.astype(np.int64, copy=False)


# ----------------------------------------------------------------------------- batching


def budget_batches(
    source: DocumentSource,
    *,
    tokens_per_batch: int | Callable[[int], int],
    context_length: int,
    seed: int | Sequence[int],
    shuffle: bool = True,
    skip_batches: int = 0,
    weights: Optional[Sequence[float]] = None,
) -> Iterator[GlobalBatch]:
    """Endless global batches (see the module docstring).

    Args:
        tokens_per_batch: the token budget of every global batch, or of global batch ``i``
            as ``tokens_per_batch(i)`` (a batch-size ramp-up).
        seed: seeds the document order (:func:`~megatron_bytescale.data.document_order.
            document_visits`: one permutation per epoch).
        skip_batches: batches to pass over first (resuming after ``skip_batches`` steps);
            costs no token reads. Without ``weights`` the start of batch ``skip_batches``
            is found by a binary search per batch (:mod:`~megatron_bytescale.data.
            batch_seek`, ~100x faster than walking: docs/benchmarks.md "resume"); a weighted
            blend walks the documents of the skipped batches (~10 µs each in Python), as its
            choice of dataset depends on every visit before.
        weights: one blend weight per dataset of ``source`` (Megatron's weighted
            ``--data-path``: shares of tokens); ``None`` shuffles all documents as one pool.
    """
    budget_of = tokens_per_batch if callable(tokens_per_batch) else (
        lambda _step, fixed=int(tokens_per_batch): fixed)
    if context_length < MIN_TOKENS:
        raise ValueError(f"the context length ({context_length}) must be at least {MIN_TOKENS}")
    if not np.any(source.lengths >= MIN_TOKENS):
        raise ValueError(f"{source.name}: no document has at least {MIN_TOKENS} tokens")
    seed = tuple(np.atleast_1d(seed).tolist())
    step, first = 0, PoolCursor(epoch=0, index=0, token=0)
    if skip_batches > 0 and weights is None:  # jump to batch skip_batches (a blend walks)
        first = seek_pool_batches(
            source.lengths, seed=seed, shuffle=shuffle, context=context_length,
            budget_of=lambda i: _checked_budget(budget_of, i), min_tokens=MIN_TOKENS,
            steps=skip_batches,
        )  # fmt: skip
        step = skip_batches
    visits = document_visits(
        source.lengths, seed=seed, datasets=source.dataset_bounds, weights=weights,
        shuffle=shuffle, min_tokens=MIN_TOKENS, start=(first.epoch, first.index),
    )  # fmt: skip
    for pieces in _batch_pieces(source, visits, budget_of, context_length, first_step=step,
                                first_token=first.token):
        if step >= skip_batches:
            yield GlobalBatch(
                lengths=tuple(p.length for p in pieces),
                tokens_by_seq=PieceTokens(source, pieces),
                meta={"source": source.name, "batch": step},
            )
        step += 1


def budget_batches_from(start_step: int, **kwargs: Any) -> Iterator[GlobalBatch]:
    """:func:`budget_batches` from global batch ``start_step`` on: the ``start_step -> batches``
    source an ``HDPDataIterator`` seeks when it resumes."""
    return budget_batches(skip_batches=start_step, **kwargs)


def _batch_pieces(source: DocumentSource, visits: Iterator[DocumentVisit],
                  budget_of: Callable[[int], int], context: int, *, first_step: int = 0,
                  first_token: int = 0) -> Iterator[list[Piece]]:
    """The pieces of batches ``first_step``, ``first_step + 1``, ...; the first visit starts
    at its token ``first_token`` (resuming: the rest was in earlier batches). The rule is the
    one :func:`~megatron_bytescale.data.batch_seek.seek_pool_batches` jumps over."""
    current: list[Piece] = []
    filled, step = 0, first_step
    budget = _checked_budget(budget_of, step)
    for visit in visits:
        length = int(source.lengths[visit.doc])
        skip, first_token = first_token, 0
        for sequence_start in range(skip - skip % context, length, context):
            # one context-length sequence of the document, spread over batches if needed
            cursor = max(sequence_start, skip)
            remaining = min(context, length - sequence_start) - (cursor - sequence_start)
            while remaining >= MIN_TOKENS:  # (the batch always has >= MIN_TOKENS room here)
                take = min(remaining, budget - filled)
                current.append(Piece(doc=visit.doc, start=cursor, length=take,
                                     epoch=visit.epoch, dataset=visit.dataset))
                filled += take
                cursor, remaining = cursor + take, remaining - take
                if budget - filled < MIN_TOKENS:
                    yield current
                    current, filled, step = [], 0, step + 1
                    budget = _checked_budget(budget_of, step)


def _checked_budget(budget_of: Callable[[int], int], step: int) -> int:
    budget = int(budget_of(step))
    if budget < MIN_TOKENS:
        raise ValueError(f"global batch {step} has a budget of {budget} tokens; it needs at "
                         f"least {MIN_TOKENS}")
    return budget


# ----------------------------------------------------------------------------- sources


def split_bounds(split: Sequence[float], num_documents: int) -> list[tuple[int, int]]:
    """Document ranges of the train / valid / test splits, as Megatron's GPT datasets cut them.

    ``split`` is the normalised ``--split`` vector (``parse_and_normalize_split``); each
    split's range is its book-ends times the document count, rounded (megatron-core's rule).
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    bounds = []
    for bookends in convert_split_vector_to_split_matrix(list(split)):
        if bookends is None:
            bounds.append((0, 0))
        else:
            lo, hi = bookends
            bounds.append((int(round(lo * num_documents)), int(round(hi * num_documents))))
    return bounds


def indexed_document_source(
    prefixes: Sequence[str], *, split: Sequence[float], split_index: int,
    cache_dir: Optional[str] = None,
) -> Optional[DocumentSource]:
    """The ``split_index``-th split (0 train, 1 valid, 2 test) of Megatron indexed datasets.

    Documents follow each dataset's ``document_indices`` (a document may span several
    sequences when the data was preprocessed with ``--split-sentences``); each prefix is split
    separately (as Megatron splits each dataset of a blend) and the prefixes' documents are
    concatenated, one dataset each. Lengths come from the ``.idx`` alone, cached per dataset
    (:func:`~.document_index.document_lengths`, on disk in ``cache_dir`` if given); tokens are
    read on demand. ``None`` if the split is empty.
    """
    from .document_index import DocumentReader, document_lengths
    from .indexed_tokens import is_indexed_prefix

    lengths: list[np.ndarray] = []
    readers: list[DocumentReader] = []
    for prefix in prefixes:
        if not is_indexed_prefix(prefix):
            raise ValueError(
                f"--data-path {prefix}: expected a Megatron indexed dataset {prefix}.bin + "
                f"{prefix}.idx (written by tools/preprocess_data.py)"
            )
        doc_lengths = document_lengths(str(prefix), cache_dir=cache_dir)
        lo, hi = split_bounds(split, len(doc_lengths))[split_index]
        lengths.append(doc_lengths[lo:hi])
        readers.append(DocumentReader(str(prefix), lo))
    if not lengths or sum(len(x) for x in lengths) == 0:
        return None
    starts = np.cumsum([0] + [len(x) for x in lengths])

    def read(doc: int, start: int, length: int) -> np.ndarray:
        k = int(np.searchsorted(starts, doc, side="right")) - 1
        return readers[k](doc - int(starts[k]), start, length)

    return DocumentSource(
        name=f"{','.join(prefixes)}[split {split_index}]",
        lengths=np.concatenate(lengths),
        read=read,
        datasets=tuple(int(x) for x in starts),
        dataset_names=tuple(str(p) for p in prefixes),
    )


def mock_document_source(
    *, vocab_size: int, context_length: int, num_tokens: int, seed: int
) -> DocumentSource:
    """Synthetic documents for ``--mock-data``: long-tailed lengths, random tokens.

    Lengths are log-normal with median 1/16 of the context (log-space std 1.5), clipped to
    the context: many short documents and a few context-length ones, so that HDP packs most of
    them and forms rings for the rest. They depend on the context, not on the capacity or the
    number of ranks, so runs that differ only in those train on the same data. Tokens are
    uniform in the vocabulary, drawn from a generator seeded per document (every rank reads
    the same tokens).
    """
    from megatron_bytescale.data.synthetic import lognormal

    lengths = lognormal(
        num_tokens, seed=seed, max_length=context_length, median=max(1.0, context_length / 16),
        sigma=1.5,
    )

    def read(doc: int, start: int, length: int) -> np.ndarray:
        rng = np.random.default_rng([seed, doc])
        tokens = rng.integers(0, vocab_size, int(lengths[doc]), dtype=np.int64)
        return tokens[start : start + length]

    return DocumentSource(name=f"mock(seed={seed})", lengths=lengths, read=read)


# ----------------------------------------------------------------------------- from Megatron's args


def build_hdp_data_iterators(args: Any) -> tuple[Any, Any, Any]:
    """Train / valid / test ``HDPDataIterator`` s (None for an empty split).

    A training global batch holds ``S x --seq-length`` tokens of whole documents (cut at
    ``--bytescale-context-length``), where ``S`` is the step's global batch size in Megatron's
    schedule (``--global-batch-size``, growing under ``--rampup-batch-size``); evaluation
    batches use ``--global-batch-size``. A weighted ``--data-path`` blends datasets by tokens.
    Resuming skips the global batches already consumed: the training steps whose sizes add up
    to ``consumed_train_samples``, ``consumed_valid_samples // --global-batch-size`` in
    evaluation.
    """
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator

    from .megatron_lm_step import hdp_manager
    from .planning import check_two_level_heads, hdp_topology, make_step_planner

    manager = hdp_manager(args)
    config = ByteScaleConfig.from_args(args)
    cost_model = cost_model_from_args(args, config)
    topology = hdp_topology(
        config, hdp_size=manager.size, cost_model=cost_model,
        global_ranks=[manager.hdp.global_rank(r) for r in range(manager.size)],
    )  # fmt: skip
    if config.two_level_ring:
        heads = int(args.num_attention_heads)
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
        check_two_level_heads(int(groups or heads) // int(args.tensor_model_parallel_size), topology)
        manager.two_level_topology = topology
    planner = make_step_planner(config, hdp_size=manager.size, cost_model=cost_model,
                                topology=topology, pp_size=manager.pp_size,
                                ep_size=manager.ep_size,
                                vpp_size=int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1))
    seq_length = int(args.seq_length)
    eval_batch_size = evaluation_global_batch_size(args)  # --eval-global-batch-size on 0.19
    tokens_per_batch = eval_batch_size * seq_length
    schedule = GlobalBatchSchedule.from_args(args, data_parallel_size=manager.size)
    device = (torch.device("cuda", torch.cuda.current_device())
              if torch.cuda.is_available() else None)
    # training follows the (ramp-up) schedule; evaluation uses --global-batch-size, as Megatron
    budgets = (lambda step: schedule.samples(step) * seq_length, tokens_per_batch,
               tokens_per_batch)
    skips = (schedule.steps_done(getattr(args, "consumed_train_samples", 0) or 0),
             (getattr(args, "consumed_valid_samples", 0) or 0) // eval_batch_size, 0)
    weights = blend_weights(args)
    iterators = []
    for split_index in range(3):
        source = _document_source(args, config, split_index, tokens_per_batch)
        if source is None:
            iterators.append(None)
            continue
        # a function of the start step: the iterator seeks it (HDPStep.index stays global)
        batches = functools.partial(
            budget_batches_from, source=source, tokens_per_batch=budgets[split_index],
            context_length=config.context_length, seed=(int(args.seed), split_index),
            weights=weights,
        )  # fmt: skip
        iterators.append(HDPDataIterator(
            batches, planner=planner, hdp=manager.hdp, plan_mode=config.plan_mode,
            check_plan_hash=config.check_plan_hash, device=device,
            prefetch=config.plan_prefetch, start_step=skips[split_index],
            dataloader=config.dataloader,
            ray_options=config.ray_loader_options() if config.dataloader == "ray" else None,
        ))  # fmt: skip
        if split_index == 0 and manager.rank == 0:
            logger.info(
                "ByteScale HDP: %d HDP ranks, capacity %d, context %d, scheduler %s, %d tokens "
                "per global batch from %s, %s loader", manager.size, config.capacity,
                config.context_length, config.scheduler, tokens_per_batch, source.name,
                config.dataloader,
            )  # fmt: skip
    return tuple(iterators)  # type: ignore[return-value]


def _document_source(args: Any, config: ByteScaleConfig, split_index: int, tokens_per_batch: int):
    if getattr(args, "mock_data", False):
        return mock_document_source(
            vocab_size=int(args.padded_vocab_size), context_length=int(config.context_length),
            num_tokens=16 * tokens_per_batch, seed=int(args.seed) + 1000 * (split_index + 1),
        )  # fmt: skip
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, _ = get_blend_from_list(args.data_path)
    split = parse_and_normalize_split(args.split or "969,30,1")
    return indexed_document_source(prefixes, split=split, split_index=split_index,
                                   cache_dir=getattr(args, "data_cache_path", None))


def blend_weights(args: Any) -> Optional[list[float]]:
    """The weights of a weighted ``--data-path`` blend (shares of tokens), else None."""
    if getattr(args, "mock_data", False) or not getattr(args, "data_path", None):
        return None
    from megatron.core.datasets.utils import get_blend_from_list

    from megatron_bytescale.data.document_order import normalized_weights

    prefixes, weights = get_blend_from_list(args.data_path)
    if weights is None:
        return None
    try:
        return normalized_weights(weights, prefixes).tolist()
    except ValueError as exc:
        raise ValueError(f"--data-path {' '.join(args.data_path)}: {exc}") from None


def cost_model_from_args(args: Any, config: ByteScaleConfig | None = None) -> Any:
    """The planner's cost model: ``--bytescale-cost-model`` JSON if given, else the analytic
    model of this model (Megatron's flags) on an H100-class GPU."""
    from megatron_bytescale.planner.cost_model import CostModel
    from megatron_bytescale.planner.presets import ModelSpec, analytic_cost_model, hardware_spec

    if config is not None and config.cost_model:
        try:
            model = CostModel.load(config.cost_model)
        except ValueError as exc:
            raise ValueError(f"--bytescale-cost-model {config.cost_model}: {exc}") from exc
        if model.num_layers != int(args.num_layers):
            raise ValueError(
                f"--bytescale-cost-model {config.cost_model} describes {model.num_layers} layers, "
                f"the model has --num-layers {args.num_layers}; fit it on this model"
            )
        return model

    heads = int(args.num_attention_heads)
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    spec = ModelSpec(
        name="megatron-args",
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        num_attention_heads=heads,
        num_query_groups=int(groups or heads),
        ffn_hidden_size=int(args.ffn_hidden_size or 4 * args.hidden_size),
        vocab_size=int(args.padded_vocab_size),
        tensor_parallel_size=int(args.tensor_model_parallel_size),
        dtype_bytes=2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4,
    )
    return analytic_cost_model(spec, hardware_spec("h100"))
