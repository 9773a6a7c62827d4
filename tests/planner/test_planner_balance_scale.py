"""Balance quality at scale, as a test: Byted-like and GitHub-like 32M-token batches, 64-1,024 ranks.

``test_balance_is_never_worse_than_naive`` holds by construction (balance keeps naive's fill as a
candidate), so it cannot see balance getting worse. Here the balance step is compared with two
lower bounds no schedule can beat, both computed in this file from the cost model's public
``micro_batch_time`` (not from ``estimate.py``):

* the work bound: rank-seconds of every micro-batch of the plan / ranks (perfect balance);
* the critical path: the longest sequence on its fastest ring of any size (a micro-batch
  carrying it cannot be faster, whatever else it carries).

The step itself is re-timed here by a plain event simulation (a ring starts when all members are
free). Widening a long sequence only to twice the work bound (a real regression: 33 s -> 65 s on
the Byted batch at 1,024 ranks) fails the 1.12x bound; so would any assignment worse than ~12 %.

With pipeline parallelism the same bound is checked (work bound per stage; the critical path
crosses every stage forward and backward, so pp times longer). PP-Balance meets it on the
GitHub batch at 1,024 ranks and on the Byted batch at 1,024 ranks with PP 4; the other cases
are expected failures (``strict``: a fix makes them pass and the marker must go), with the
measured ratio in the reason. That bound leaves out what 1F1B itself costs: every pipeline of a
long ring idles (pp - 1) x that micro-batch's stage time while it crosses the other stages
(a stage runs only its few in-flight neighbours meanwhile). Counting that fill and drain per
pipeline (stage work + (pp - 1) x longest micro-batch, averaged over the pipelines) puts
PP-Balance within 1.00-1.24x of it in these cases (docs/benchmarks.md, section "pipeline").
Selective offload (the offload-free plan as a candidate) and a short micro-batch first in every
pipeline brought the misses from 1.30-1.73x to 1.16-1.57x; PP-Balance's level steps to
1.16-1.55x (github-256-pp4 1.36 -> 1.27); none reaches 1.1x.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bytescale.data.synthetic import synthetic_lengths
from megatron_bytescale.planner.presets import preset_cost_model
from megatron_bytescale.planner.schedulers import make_plan

TOKENS = 32 * 2**20
CONTEXT = 2_097_152
CAPACITY = 8192
# "about 1.1x": the worst case measured is 1.109 (GitHub, 256 ranks, no offload), where every
# ring of 2-7 ranks must sit inside one 8-rank node (docs/topology.md); placed on the
# least-loaded ranks wherever they are, the same batch measured 1.098
DP_BOUND = 1.12
BOUND = 1.1  # PP-Balance

CM = preset_cost_model("llama-7b")
_LENGTHS: dict[tuple[str, int], np.ndarray] = {}


def lengths_of(dataset: str, seed: int) -> np.ndarray:
    if (dataset, seed) not in _LENGTHS:
        _LENGTHS[(dataset, seed)] = synthetic_lengths(dataset, TOKENS, seed=seed, max_length=CONTEXT)
    return _LENGTHS[(dataset, seed)]


def micro_batches(plan):
    """{order: (ring, lengths, offload_ratio)} over the whole plan."""
    lengths = plan.sequence_lengths()
    out = {}
    for rp in plan.ranks:
        for mb in rp.micro_batches:
            out.setdefault(mb.order, (mb.ring, [lengths[s] for s in mb.seqs], mb.offload_ratio))
    return out


def member_seconds(plan, ring, lengths, ratio) -> float:
    return CM.micro_batch_time(lengths, len(ring), layers=plan.layers_per_stage, offload_ratio=ratio,
                               align=plan.align, intra_node=CM.ring_is_intra_node(ring))


def retimed_step(plan) -> tuple[float, float]:
    """(step, work bound) of a PP = 1 plan by a plain event simulation in global order."""
    free = np.zeros(plan.hdp_size)
    work = 0.0
    for order, (ring, lengths, ratio) in sorted(micro_batches(plan).items()):
        t = member_seconds(plan, ring, lengths, ratio)
        members = list(ring)
        free[members] = free[members].max() + t
        work += t * len(ring)
    return float(free.max()), work / plan.hdp_size


def critical_path(plan, top: int = 3) -> float:
    """The slowest of the ``top`` longest sequences, each alone on its fastest ring size."""
    longest = sorted((s.length for s in plan.sequences), reverse=True)[:top]
    best = 0.0
    for n in longest:
        fastest = min(
            CM.micro_batch_time([n], d, layers=plan.layers_per_stage, align=plan.align,
                                intra_node=d <= CM.ranks_per_node)
            for d in range(1, plan.hdp_size + 1)
        )
        best = max(best, fastest)
    return best


CASES = [
    # (dataset, ranks, offload, seed); 64 ranks cannot hold a 2M sequence without offload
    ("byted", 64, True, 0),
    ("github", 64, True, 0),
    ("byted", 256, True, 0),
    ("byted", 256, False, 1),
    ("github", 256, True, 1),
    ("github", 256, False, 0),
    ("byted", 1024, True, 0),
    ("byted", 1024, False, 0),
    ("github", 1024, True, 0),
    ("github", 1024, False, 1),
]


@pytest.mark.parametrize("dataset, ranks, offload, seed", CASES, ids=[f"{c[0]}-{c[1]}-offload{int(c[2])}-seed{c[3]}" for c in CASES])
def test_balance_is_within_ten_percent_of_the_lower_bounds(dataset, ranks, offload, seed):
    plan = make_plan(lengths_of(dataset, seed), scheduler="balance", hdp_size=ranks, capacity=CAPACITY,
                     cost_model=CM, context_length=CONTEXT, offload=offload)
    # the LPT assignment is what ran: a fallback (naive's fill) cannot hide a regression of it
    assert plan.meta["assignment"] == "lpt", plan.meta
    assert plan.meta["offload"] is offload
    # with offload allowed, balance keeps Eq. 3's offloaded rings only where they are faster
    # (selective offload; on the GitHub batch at 1,024 ranks the offload-free plan wins)
    assert (plan.meta["offloaded_micro_batches"] > 0) == (plan.meta["offload_choice"] == "eq3")
    step, work_bound = retimed_step(plan)
    assert plan.estimate.step_time_s == pytest.approx(step, rel=1e-9)
    bound = max(work_bound, critical_path(plan))
    assert step <= DP_BOUND * bound, (
        f"{dataset} on {ranks} ranks: step {step:.2f} s > {DP_BOUND} x max(work bound "
        f"{work_bound:.2f} s, critical path {critical_path(plan):.2f} s)")


PP_CASES = [
    # (dataset, ranks, pp, measured step / max(work bound, critical path) when it misses)
    ("github", 1024, 2, None),
    ("github", 1024, 4, None),
    ("byted", 1024, 2, 1.16),
    ("byted", 1024, 4, None),
    ("byted", 256, 2, 1.34),
    ("github", 256, 4, 1.27),
    ("github", 64, 2, 1.49),
    ("byted", 64, 4, 1.55),
]


def _pp_case(dataset, ranks, pp, missed):
    marks = () if missed is None else pytest.mark.xfail(
        strict=True, reason=f"PP-Balance measures {missed:.2f}x the bound (1F1B fill and drain of the longest ring)")
    return pytest.param(dataset, ranks, pp, marks=marks, id=f"{dataset}-{ranks}-pp{pp}")


@pytest.mark.parametrize("dataset, ranks, pp", [_pp_case(*c) for c in PP_CASES])
def test_pipeline_balance_is_within_ten_percent_of_the_lower_bounds(dataset, ranks, pp):
    plan = make_plan(lengths_of(dataset, 0), scheduler="balance", hdp_size=ranks, capacity=CAPACITY,
                     cost_model=CM, context_length=CONTEXT, offload=True, pp_size=pp)
    assert plan.meta["mode"] == "PP-Balance" and plan.layers_per_stage == CM.num_layers // pp
    work = sum(member_seconds(plan, ring, lengths, ratio) * len(ring)
               for ring, lengths, ratio in micro_batches(plan).values()) / ranks
    bound = max(work, pp * critical_path(plan))
    step = plan.estimate.step_time_s
    assert step <= BOUND * bound, f"step {step:.2f} s = {step / bound:.2f} x max(work {work:.2f} s, critical path)"
