"""MoE under HDP with TP 2 (sequence parallelism), with PP 2 and with both (TP 2 x PP 2), at
expert parallelism 1 (and 2 for TP and for PP), with expert-tensor parallelism other than TP
(TP 2 x ETP 1 x EP 2 / 4, TP 1 x ETP 2 x EP 2, TP 2 x PP 2 x ETP 1 x EP 2, the last also with
two interleaved stages), and at TP 4 (EP 1, ETP 1 x EP 4, ETP 2 x EP 2), on 4 CPU ranks: every
gradient equals megatron-core's single-process MoE, and at TP 2 so does the logged router loss.

All layouts share ONE 4-process spawn (module-scoped fixture); see ``moe_parallel_cases.py``,
``moe_epp_cases.py``, ``moe_etp_cases.py``, ``moe_tp4_cases.py`` and ``moe_vpp_cases.py``.
"""

from __future__ import annotations

import pytest

from megatron_bytescale.testing.distributed import run_distributed

from .moe_etp_cases import ETP_LAYOUTS, TPP_ETP_LAYOUT, TPP_ETP_RUNS
from .moe_parallel_cases import moe_parallel_rank_body
from .moe_tp4_cases import TP4_LAYOUTS, TP4_QUERY_GROUPS, TP4_RUNS
from .moe_vpp_cases import VPP_RUN

TOLERANCE = 1e-5
TP_RUNS = ["tp alltoall aux 0", "tp alltoall aux", "tp allgather aux"]
PP_RUNS = ["pp balance aux", "pp manual aux 0", "pp manual aux"]
TP_EP_RUNS = ["tp ep manual aux 0", "tp ep manual aux", "tp ep balance aux"]
PP_EP_RUNS = ["pp ep manual aux 0", "pp ep manual aux", "pp ep balance aux"]
TPP_RUNS = ["tpp manual aux 0", "tpp manual aux", "tpp balance aux"]
ETP_RUNS = [f"{layout} manual aux" for layout, *_ in ETP_LAYOUTS]


@pytest.fixture(scope="module")
def results():
    return run_distributed(4, moe_parallel_rank_body, timeout_s=900)


def test_the_layouts_and_plans_are_the_ones_meant(results):
    for run in TP_RUNS:
        info = [r["runs"][run] for r in results]
        assert all(i["tp_size"] == 2 and i["pp_size"] == 1 and i["sequence_parallel"]
                   for i in info)
        assert info[0]["ring_sizes"] == [1, 2]
    for run in PP_RUNS:
        info = [r["runs"][run] for r in results]
        assert all(i["tp_size"] == 1 and i["pp_size"] == 2 for i in info)
        assert info[0]["ring_sizes"][-1] == 2
    assert results[0]["runs"]["pp manual aux"]["micro_batch_counts"] == [6, 4]
    for run in TPP_RUNS:
        info = [r["runs"][run] for r in results]
        assert all(i["tp_size"] == 2 and i["pp_size"] == 2 and i["sequence_parallel"]
                   for i in info), run
        assert sorted((i["tp"], i["pp"]) for i in info) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert info[0]["ring_sizes"] == [1], run  # one HDP rank: no rings
    # the manual plan: six micro-batches through both stages, two of them packs
    assert results[0]["runs"]["tpp manual aux"]["micro_batch_counts"] == [6]
    assert results[0]["runs"]["tpp manual aux"]["packs"] == 2
    assert results[0]["runs"]["tpp balance aux"]["micro_batch_counts"][0] > 1


def test_the_expert_parallel_layouts_and_plans_are_the_ones_meant(results):
    """EP 2 over the 2 HDP ranks of each TP rank / each stage: one expert group per TP rank /
    stage; the manual plan has a ring of 2, a pack and counts 5 / 4, so rank (pipeline) 1 runs
    an empty slot; the balance plans (made with ep_size 2) keep their rings at one slot."""
    for runs, tp, pp, groups in ((TP_EP_RUNS, 2, 1, [[0, 2], [1, 3], [0, 2], [1, 3]]),
                                 (PP_EP_RUNS, 1, 2, [[0, 1], [0, 1], [2, 3], [2, 3]])):
        for run in runs:
            info = [r["runs"][run] for r in results]
            assert all(i["tp_size"] == tp and i["pp_size"] == pp and i["ep_size"] == 2
                       for i in info), run
            assert [i["expert_group"] for i in info] == groups, run
            assert info[0]["ring_sizes"][-1] == 2, run
            assert all(i["sequence_parallel"] == (tp == 2) for i in info)
        manual = results[0]["runs"][runs[0]]
        assert manual["ring_sizes"] == [1, 2]
        assert manual["micro_batch_counts"] == [5, 4] and manual["slots"] == [5, 5]


def test_random_plans_train_at_pp_2_ep_2_without_deadlock(results):
    """A few balance plans (ep_size 2) at PP 2 x EP 2: every step trains all its tokens, with
    empty slots and rings among them; a deadlock would trip the spawn's timeout."""
    from .moe_epp_cases import PP_STRESS_PLANS

    stress = [r["ep stress"] for r in results]
    assert all(s["steps"] == PP_STRESS_PLANS for s in stress)
    first_stage = [s for s in stress if s["stage"] == 0]
    assert len(first_stage) == 2
    assert sum(s["trained_tokens"] for s in first_stage) == stress[0]["total_tokens"]
    assert stress[0]["empty_slots"] > 0 and stress[0]["rings"] > 0


def _check_loss_and_gradients(results, run: str, holders, case: str) -> tuple[int, int]:
    """The run's loss (summed over the ranks that hold it) equals the reference's, and every
    rank's every gradient is within the tolerance; returns how many router and expert
    parameters the ranks compared."""
    loss = sum(i["loss_sum"] for i in holders) / holders[0]["global_loss_tokens"]
    ref = results[0]["reference_loss"][case]
    assert abs(loss - ref) / abs(ref) <= TOLERANCE
    routers = experts = 0
    for r in results:
        errors = r["runs"][run]["grad_errors"]
        routers += sum(".mlp.router." in n for n in errors)
        experts += sum(".mlp.experts." in n for n in errors)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{run} rank {r['rank']}: {worst} {errors[worst]:.2e}"
    return routers, experts


@pytest.mark.parametrize("run", TP_RUNS + PP_RUNS + TPP_RUNS + TP_EP_RUNS + PP_EP_RUNS)
def test_moe_gradients_equal_megatron_alone(results, run):
    case = "aux 0" if run.endswith("aux 0") else "aux"
    # the loss of one TP rank / the last stage's HDP group is the whole batch's loss
    if run.startswith("tpp"):  # TP x PP: the last stage's TP rank 0
        holders = [r["runs"][run] for r in results
                   if r["runs"][run]["tp"] == 0 and r["runs"][run]["pp"] == 1]
    elif run.startswith("tp"):
        holders = [r["runs"][run] for r in results if r["runs"][run]["tp"] == 0]
    else:
        holders = [r["runs"][run] for r in results if r["runs"][run]["pp"] == 1]
    routers, experts = _check_loss_and_gradients(results, run, holders, case)
    # every rank holds the routers and experts of its layers: 2 layers x 4 ranks (TP) or
    # 1 layer x 4 ranks (PP, TP x PP); 4 experts (2 with EP 2) x 2 linears each
    layers = 8 if run.startswith("tp ") else 4
    local_experts = 2 if " ep " in run else 4
    assert routers == layers and experts == layers * local_experts * 2


@pytest.mark.parametrize("control", ["control: TP counts not summed",
                                     "control: TP x PP counts not summed"])
def test_the_gradient_check_catches_tp_counts_left_unsummed(results, control):
    """Each TP rank's own counts in the load-balancing loss move the router's gradient far
    beyond the tolerance, so the TP (and TP x PP, on both stages) equality above is not luck."""
    stages = {r["runs"][control]["pp"] for r in results}
    for stage in stages:
        worst = max(v for r in results if r["runs"][control]["pp"] == stage
                    for n, v in r["runs"][control]["grad_errors"].items() if ".mlp.router." in n)
        assert worst > 100 * TOLERANCE, (control, stage, worst)


def test_the_expert_tensor_parallel_layouts_keep_the_right_hdp_ranks_in_step(results):
    """An expert group (megatron-core's ETP x EP tensor-and-expert group) spans
    max(1, ETP x EP / TP) consecutive HDP ranks; the plan keeps exactly those in step: none at
    TP 2 x ETP 1 x EP 2 (the group is one HDP rank's TP pair: counts 5 / 4, no empty slot), both
    HDP ranks at TP 2 x ETP 1 x EP 4 and all four at TP 1 x ETP 2 x EP 2 (empty slots)."""
    for (layout, tp, etp, ep, lockstep), run in zip(ETP_LAYOUTS, ETP_RUNS):
        info = [r["runs"][run] for r in results]
        assert all(i["tp_size"] == tp and i["pp_size"] == 1 and i["expert_tp_size"] == etp
                   and i["expert_model_parallel_size"] == ep and i["sequence_parallel"] == (tp > 1)
                   for i in info), run
        assert all(i["ep_size"] == i["plan_ep_size"] == lockstep for i in info), run
        # the expert group: ETP x EP consecutive global ranks
        block = etp * ep
        assert [i["expert_group"] for i in info] == [
            list(range(r - r % block, r - r % block + block)) for r in range(4)], run
        assert info[0]["ring_sizes"] == [1, 2], run
    counts = {run: results[0]["runs"][run]["micro_batch_counts"] for run in ETP_RUNS}
    slots = {run: results[0]["runs"][run]["slots"] for run in ETP_RUNS}
    assert counts[ETP_RUNS[0]] == slots[ETP_RUNS[0]] == [5, 4]
    assert counts[ETP_RUNS[1]] == [5, 4] and slots[ETP_RUNS[1]] == [5, 5]
    assert counts[ETP_RUNS[2]] == [3, 2, 2, 2] and slots[ETP_RUNS[2]] == [3, 3, 3, 3]
    assert results[0]["runs"][ETP_RUNS[2]]["packs"] == 1


@pytest.mark.parametrize("run", ETP_RUNS)
def test_moe_gradients_equal_megatron_alone_with_expert_tensor_parallelism(results, run):
    layout, tp, etp, ep, _ = ETP_LAYOUTS[ETP_RUNS.index(run)]
    holders = [r["runs"][run] for r in results if r["runs"][run]["tp"] == 0]
    routers, experts = _check_loss_and_gradients(results, run, holders, "aux")
    # 2 layers x 4 ranks, each holding 4 / EP experts (split over ETP ranks) x 2 linears
    assert routers == 8 and experts == 8 * (4 // ep) * 2, (routers, experts)


def test_the_expert_tensor_parallel_layout_with_pp_is_the_one_meant(results):
    """TP 2 x PP 2 x ETP 1 x EP 2 (HDP 1): at each stage the expert group is that stage's TP
    pair, so no HDP ranks are kept in step (``ep_size`` 1); the manual plan runs six
    micro-batches (two packs) through both stages, the balance plan its own several."""
    _, tp, pp, etp, ep, lockstep = TPP_ETP_LAYOUT
    for run in TPP_ETP_RUNS:
        info = [r["runs"][run] for r in results]
        assert all(i["tp_size"] == tp and i["pp_size"] == pp and i["expert_tp_size"] == etp
                   and i["expert_model_parallel_size"] == ep and i["sequence_parallel"]
                   for i in info), run
        assert all(i["ep_size"] == i["plan_ep_size"] == lockstep for i in info), run
        assert sorted((i["tp"], i["pp"]) for i in info) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        # the expert group of each stage: its TP pair (global ranks 0-1 and 2-3)
        assert [i["expert_group"] for i in info] == [[0, 1], [0, 1], [2, 3], [2, 3]], run
        assert info[0]["ring_sizes"] == [1], run  # one HDP rank: no rings
    manual, balance = (results[0]["runs"][run] for run in TPP_ETP_RUNS)
    assert manual["micro_batch_counts"] == manual["slots"] == [6] and manual["packs"] == 2
    assert balance["micro_batch_counts"][0] > 1


@pytest.mark.parametrize("run", TPP_ETP_RUNS)
def test_moe_gradients_equal_megatron_alone_with_etp_and_pp(results, run):
    # the loss: the last stage's TP rank 0; every rank holds one layer's router and its two
    # whole experts (EP 2, ETP 1) x 2 linears
    holders = [r["runs"][run] for r in results
               if r["runs"][run]["tp"] == 0 and r["runs"][run]["pp"] == 1]
    routers, experts = _check_loss_and_gradients(results, run, holders, "aux")
    assert routers == 4 and experts == 4 * 2 * 2, (routers, experts)


def test_the_logged_router_losses_at_tp_2_are_the_documents_own_weighted_by_tokens(results):
    """At TP 2 with sequence parallelism each TP rank holds its rows' share of every router loss:
    Megatron-LM's logged values (reduced over TP x HDP) equal megatron-core's log of each
    document alone, weighted by tokens, within 1e-5 on every rank; reduced over the HDP group
    alone (the all-gather run, a negative control) they miss the other TP rank's share."""
    reference = results[0]["reference_log"]
    assert set(reference) == {"load_balancing_loss", "z_loss"}
    assert all(v > 0 for v in reference.values())
    for r in results:
        log = r["runs"]["tp alltoall aux"]["log"]
        assert set(log) == set(reference), log
        for name, value in reference.items():
            assert abs(log[name] - value) / value <= TOLERANCE, (r["rank"], name, log[name], value)
        control = r["runs"]["tp allgather aux"]["log"]
        assert set(control) == set(reference), control
        for name, value in reference.items():
            assert abs(control[name] - value) / value > 100 * TOLERANCE, (r["rank"], name)


def test_the_tp_4_layouts_and_plan_are_the_ones_meant(results):
    """TP 4 (HDP 1, sequence parallelism) with the experts split four ways (EP 1), one whole
    expert per rank (ETP 1 x EP 4: the expert group is the TP group) and ETP 2 x EP 2: the
    expert group lies inside the TP group, so no HDP ranks in step; one rank, five
    micro-batches, one a pack of three documents."""
    for (layout, etp, ep), run in zip(TP4_LAYOUTS, TP4_RUNS):
        info = [r["runs"][run] for r in results]
        assert all(i["tp_size"] == 4 and i["pp_size"] == 1 and i["sequence_parallel"]
                   and i["expert_tp_size"] == etp and i["expert_model_parallel_size"] == ep
                   and i["query_groups"] == TP4_QUERY_GROUPS for i in info), run
        assert sorted(i["tp"] for i in info) == [0, 1, 2, 3], run
        assert all(i["ep_size"] == i["plan_ep_size"] == 1 for i in info), run
        block = etp * ep  # megatron-core's tensor-and-expert group: ETP x EP consecutive ranks
        assert [i["expert_group"] for i in info] == [
            list(range(r - r % block, r - r % block + block)) for r in range(4)], run
        assert info[0]["ring_sizes"] == [1] and info[0]["micro_batch_counts"] == [5], run
        assert info[0]["packs"] == 2, run


@pytest.mark.parametrize("run", TP4_RUNS)
def test_moe_gradients_equal_megatron_alone_at_tp_4(results, run):
    layout, etp, ep = TP4_LAYOUTS[TP4_RUNS.index(run)]
    holders = [r["runs"][run] for r in results if r["runs"][run]["tp"] == 0]
    routers, experts = _check_loss_and_gradients(results, run, holders, "tp4 aux")
    # 2 layers x 4 ranks, each holding 4 / EP experts (split over ETP ranks) x 2 linears
    assert routers == 8 and experts == 8 * (4 // ep) * 2, (routers, experts)


def test_the_interleaved_moe_layout_is_the_one_meant(results):
    """TP 2 x PP 2 x VPP 2 x ETP 1 x EP 2 (HDP 1): each stage's expert group is its TP pair
    (block 1: the interleaved driver needs no slot rule); chunk c of stage s holds layer
    2c + s + 1; the manual plan's six micro-batches (two packs) run through both stages."""
    info = [r["runs"][VPP_RUN] for r in results]
    assert all(i["tp_size"] == 2 and i["pp_size"] == 2 and i["vpp"] == 2 and i["sequence_parallel"]
               and i["expert_tp_size"] == 1 and i["expert_model_parallel_size"] == 2
               and i["ep_size"] == i["plan_ep_size"] == 1 for i in info)
    assert sorted((i["tp"], i["pp"]) for i in info) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [i["expert_group"] for i in info] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [i["layers"] for i in info] == [[[1], [3]], [[1], [3]], [[2], [4]], [[2], [4]]]
    assert info[0]["micro_batch_counts"] == [6] and info[0]["packs"] == 2


def test_moe_gradients_equal_megatron_alone_with_interleaved_stages(results):
    holders = [r["runs"][VPP_RUN] for r in results
               if r["runs"][VPP_RUN]["tp"] == 0 and r["runs"][VPP_RUN]["pp"] == 1]
    routers, experts = _check_loss_and_gradients(results, VPP_RUN, holders, "vpp aux")
    # 4 ranks x 2 chunks of one layer: its router and its two whole experts x 2 linears
    assert routers == 8 and experts == 8 * 2 * 2, (routers, experts)
