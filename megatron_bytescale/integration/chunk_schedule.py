"""Split ring micro-batches (Seq1F1B-style chunks) in the pipeline driver.

A plan may split a long ring micro-batch into ``k`` causal chunks that follow each other
through the pipeline (``MicroBatch.chunk``, docs/pipeline.md). Each chunk is a micro-batch of
its own for the driver: its own forward, its own backward, its own activations between stages.
What they share is the attention's kept prefix: every attention layer keeps the K/V of earlier
chunks (:class:`megatron_bytescale.runtime.ChunkPrefix`), so the driver gives every chunk of a
group one dict of those (:func:`share_chunk_prefixes`) and runs the group's backwards in
reverse (:func:`stage_ops`, from :func:`.pipeline_floor.pipeline_stage_ops`). The autograd
graphs stay per chunk: what a later chunk owes an earlier one's K/V travels through the
``ChunkPrefix``, not through autograd, so nothing else of the driver changes.

**Why the reversed groups keep 1F1B deadlock-free.** On a stage, the j-th backward is preceded
by ``max(min(m, w + j + 1), x_j + 1)`` forwards (``w`` the warm-up, ``x_j`` the local index of
that backward's micro-batch; :func:`.pipeline_floor.stage_ops`). A group of chunks only permutes
backwards within its own index range, so a ring micro-batch (split or not; its chunks are the
same group on every member) has the same backward position ``j`` on every member pipeline, and
for a ring forward at index ``x < m`` the test ``x < max(min(m, w + j + 1), x_j + 1)`` does not
depend on ``m``. Hence every member orders any two ring ops the same way, as plain 1F1B does;
the random plans of ``tests/integration/test_pp_chunks.py`` run this driver under a time-out.

The PP = 1 driver runs forward and backward of a micro-batch back to back, which a chunk
cannot (its backward needs the later chunks' first), so it refuses such plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_bytescale.planner.order import pipeline_ops
from megatron_bytescale.planner.pipeline_floor import pipeline_stage_ops

if TYPE_CHECKING:
    from megatron_bytescale.data.hdp_iterator import HDPStep
    from megatron_bytescale.runtime import MicroBatchTensors


def chunk_groups(step: "HDPStep") -> dict[int, int]:
    """Local index -> the order of its group's chunk 0, for every chunk of this pipeline."""
    return {i: mb.order - mb.chunk[0] for i, mb in enumerate(step.micro_batches) if mb.chunk is not None}


def stage_ops(step: "HDPStep", pp: int, stage: int, count: int | None = None) -> list[tuple[str, int]]:
    """This stage's ``("F" | "B", local index)`` ops: 1F1B, each chunk group's backwards reversed.

    ``count``: micro-batches to run (default the pipeline's own; more with expert parallelism,
    whose empty slots follow them and are never chunks)."""
    count = step.num_micro_batches if count is None else count
    groups = chunk_groups(step)
    if not groups:
        return pipeline_ops(count, pp, stage)
    return [(phase, unit) for phase, unit, _ in
            pipeline_stage_ops(list(range(count)), pp, 1, stage, chunk_groups=groups)]


def share_chunk_prefixes(tensors: "MicroBatchTensors", stores: dict[int, dict]) -> "MicroBatchTensors":
    """Give a chunk its group's dict of kept prefixes (one per group, created on first use)."""
    if tensors.chunk is not None:
        tensors.chunk_prefixes = stores.setdefault(tensors.order - tensors.chunk.chunk, {})
    return tensors


def refuse_chunks_without_pipeline(step: "HDPStep") -> None:
    """The PP = 1 driver cannot run split micro-batches: say so before anything runs."""
    split = sorted({mb.order - mb.chunk[0] for mb in step.micro_batches if mb.chunk is not None})
    if split:
        raise ValueError(
            f"step {step.index}: the plan splits ring micro-batches (orders {split[:5]}) into "
            "chunks along the pipeline, which needs pipeline parallelism; plan without chunks "
            "for --pipeline-model-parallel-size 1"
        )
