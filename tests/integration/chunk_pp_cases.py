"""Per-rank body of the split-micro-batch (Seq1F1B-style chunks) tests: PP 2 x HDP 2.

Same setup as ``parallel_cases`` (one spawn, reference = Megatron's own GPT at TP 1 / PP 1 on
every sequence alone): hand-made plans in which a ring micro-batch, or a local one, runs as
causal chunks through the pipeline; each rank compares its reduced gradients with the reference.
Then random plans with chunks train on under the spawn's time-out (a deadlock fails the test).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .hdp_cases import VOCAB
from .parallel_cases import CAPACITY, hdp_step, layout_config, reference_phase, switch_layout

RANDOM_PLANS = 8


def chunk_plan(lengths: list[int], adds: list[tuple[tuple[int, ...], int, int]], hdp_size: int = 2):
    """A PP-2 plan from ``(ring, seq, num_chunks)`` additions, in order (orders follow them)."""
    from megatron_bytescale.planner.plan import PlanBuilder

    builder = PlanBuilder(hdp_size=hdp_size, capacity=CAPACITY, lengths=dict(enumerate(lengths)))
    for ring, seq, chunks in adds:
        builder.add(ring, [seq], num_chunks=chunks)
    return builder.build(scheduler="manual", pp_size=2, layers_per_stage=1).validate()


# ring = both pipelines; (0,) / (1,) = a local micro-batch of that pipeline
RUNS = {
    # a ring of 2 split into 2 chunks, then locals (one pipeline's local split in 3), then a
    # ring at the same local index in both
    "ring chunks": ([150, 40, 31, 60, 20, 13, 120],
                    [((0, 1), 0, 2), ((0,), 1, 1), ((0,), 2, 1), ((1,), 3, 3), ((0,), 4, 1),
                     ((1, 0), 6, 1), ((1,), 5, 1)]),
    # pipeline 0 splits a local micro-batch, pipeline 1 has no chunk; then a ring at local
    # index 2 of both, whose backward each pipeline reaches by a different order
    "one pipeline without chunks": ([70, 33, 25, 41, 140],
                                    [((0,), 0, 2), ((1,), 1, 1), ((1,), 2, 1), ((0, 1), 4, 1),
                                     ((0,), 3, 1)]),
    # pipeline 1 runs nothing; pipeline 0 a local split in 3 and a plain one
    "idle pipeline": ([77, 30], [((0,), 0, 3), ((0,), 1, 1)]),
}


# planned by make_step_planner with --bytescale-seq-split (balance, PP 2, HDP 2, capacity 80):
# the 149-token document's ring of 2 is split into 2 chunks (it pays and its kept prefix fits)
PLANNED_RUNS = {"planner seq split": [4, 12, 149]}


def seq_split_plan(lengths: list[int]):
    """The plan ``--bytescale-seq-split`` makes for ``lengths`` on this layout."""
    from megatron_bytescale.integration.config import ByteScaleConfig
    from megatron_bytescale.integration.planning import make_step_planner
    from megatron_bytescale.planner.cost_model import CostModel

    cm = CostModel(name="toy", num_layers=2, alpha1=1e-9, beta1=1e-6, gamma=1e-5, alpha2=1000.0,
                   d2h_bandwidth=1e8, h2d_bandwidth=1e8, kv_bytes_per_token=64.0, dkv_bytes_per_token=128.0,
                   p2p_bandwidth_intra=1e9, p2p_bandwidth_inter=1e8, p2p_latency_s=1e-6, ranks_per_node=4)
    config = ByteScaleConfig(hdp=True, capacity=CAPACITY, seq_split=True)
    return make_step_planner(config, hdp_size=2, cost_model=cm, pp_size=2)(lengths).validate()


def random_chunk_plan(rng: np.random.Generator):
    """Random pipelines (zero micro-batches included), rings only where both lists are equally
    long (the same local index), any micro-batch split into 1-3 chunks."""
    counts = [0, 0]
    lengths: list[int] = []
    adds = []
    for _ in range(int(rng.integers(1, 7))):
        chunks = int(rng.choice([1, 2, 2, 3]))
        if counts[0] == counts[1] and rng.random() < 0.4:
            lengths.append(int(rng.integers(CAPACITY + 1, 2 * CAPACITY + 1)))
            ring: tuple[int, ...] = (0, 1) if rng.random() < 0.5 else (1, 0)
        else:
            lengths.append(int(rng.integers(4, CAPACITY + 1)))
            ring = (0,) if rng.random() < 0.7 else (1,)
        adds.append((ring, len(lengths) - 1, chunks))
        for r in ring:
            counts[r] += chunks
    return lengths, chunk_plan(lengths, adds)


def chunk_rank_body(rank: int, world_size: int) -> dict[str, Any]:
    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration.schedule import run_hdp_step
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron

    enable_cpu_megatron()
    rng = np.random.default_rng(21)
    batches = {}
    for name in RUNS:
        lengths, adds = RUNS[name]
        batches[name] = ([rng.integers(0, VOCAB, n).tolist() for n in lengths],
                         chunk_plan(lengths, adds))
    for name, lengths in PLANNED_RUNS.items():
        batches[name] = ([rng.integers(0, VOCAB, n).tolist() for n in lengths], seq_split_plan(lengths))
    references = reference_phase(*(b[0] for b in batches.values()), share_embeddings=True)
    manager = switch_layout(pipeline_model_parallel_size=2)
    rank_map = manager.rank_map
    out: dict[str, Any] = {"rank": rank, "stage": rank_map.pp_rank, "hdp": rank_map.hdp_rank,
                           "runs": {}}  # fmt: skip
    config = layout_config()
    ddp = optimizer = None
    for (name, (sequences, plan)), reference in zip(batches.items(), references):
        step, record, errors = hdp_step(config, reference, sequences, scheduler="manual",
                                        manager=manager, planner=lambda _, plan=plan: plan)
        out["runs"][name] = {
            "reference_loss": reference["loss"],
            "counts": plan.micro_batch_counts(),
            "chunks": [[mb.chunk for mb in rp.micro_batches] for rp in plan.ranks],
            "loss_sum": record.loss_sum,
            "global_loss_tokens": record.global_loss_tokens,
            "grad_errors": errors,
        }
    # random plans with chunks: one model trains on through all of them
    from .parallel_cases import fresh_model

    ddp, optimizer = fresh_model(config, references[0], share_embeddings=True)
    stress = []
    for _ in range(RANDOM_PLANS):
        lengths, plan = random_chunk_plan(rng)
        tokens = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
        step = next(HDPDataIterator([tokens], planner=lambda _, plan=plan: plan, hdp=manager.hdp))
        record = run_hdp_step(step, model=ddp, optimizer=optimizer, manager=manager)
        stress.append({"counts": plan.micro_batch_counts(),
                       "chunked": sum(1 for rp in plan.ranks for mb in rp.micro_batches if mb.chunk),
                       "loss_sum": record.loss_sum, "global_loss_tokens": record.global_loss_tokens,
                       "tokens": sum(lengths), "sequences": len(lengths)})  # fmt: skip
    out["stress"] = stress
    return out
