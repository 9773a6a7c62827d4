"""``StepPlan.validate()`` rejects every broken invariant, and ``from_json`` every malformed input.

Training trusts ``validate()`` alone (the iterator validates every plan before any rank trains on
it), so each invariant of DESIGN.md §4 is broken here one at a time in a valid hand-made plan, and
the message must name what broke. Plans are edited in their JSON form (the contract), not through
internals. A brute-force checker written in this file (token sets, no zigzag helper) is the
independent reference for a fuzz over random single edits.
"""

from __future__ import annotations

import copy
import json
import math
import random

import pytest

from megatron_bytescale.planner.plan import PlanBuilder, PlanError, StepPlan

# --------------------------------------------------------------------------- the valid plan
# 4 ranks, capacity 16, align 2. Orders and holdings, by hand:
#   order 0: sequence 0 (30 tokens) on ring (0, 2, 1): 6 parts of ceil(30/6) = 5 -> 6 tokens:
#            [0,6) [6,12) [12,18) [18,24) [24,30) [30,30)
#            rank 0 (position 0): parts 0, 5 -> (0, 6)
#            rank 2 (position 1): parts 1, 4 -> (6, 12), (24, 30)
#            rank 1 (position 2): parts 2, 3 -> (12, 18), (18, 24)
#   order 1: sequence 1 (5 tokens) alone on rank 3
#   order 2: sequences 2 (7) and 4 (3) packed on rank 0
#   order 3: sequence 3 (12 tokens) on ring (3, 1): 4 parts of 3 -> 4: [0,4) [4,8) [8,12) [12,12)
#            rank 3: (0, 4); rank 1: (4, 8), (8, 12)
LENGTHS = {0: 30, 1: 5, 2: 7, 3: 12, 4: 3}
PIECES_BY_HAND = {
    0: [(0, [(0, 0, 6)]), (2, [(2, 0, 7), (4, 0, 3)])],
    1: [(0, [(0, 12, 18), (0, 18, 24)]), (3, [(3, 4, 8), (3, 8, 12)])],
    2: [(0, [(0, 6, 12), (0, 24, 30)])],
    3: [(1, [(1, 0, 5)]), (3, [(3, 0, 4)])],
}


def valid_plan() -> StepPlan:
    b = PlanBuilder(hdp_size=4, capacity=16, lengths=LENGTHS, align=2)
    b.add([0, 2, 1], [0])
    b.add([3], [1])
    b.add([0], [2, 4])
    b.add([3, 1], [3])
    return b.build(scheduler="hand")


def valid_dict() -> dict:
    return valid_plan().to_dict()


def test_the_base_plan_is_valid_and_holds_the_pieces_computed_by_hand():
    plan = valid_plan().validate()
    for rank, expected in PIECES_BY_HAND.items():
        got = [(mb.order, [(p.seq, p.start, p.end) for p in mb.pieces])
               for mb in plan.ranks[rank].micro_batches]
        assert got == expected
    assert brute_force_problems(valid_dict()) == []


# --------------------------------------------------------------------------- independent checker
def brute_force_problems(d: dict) -> list[str]:
    """Everything wrong with a plan dict, by brute force on token sets (the test's reference).

    Deliberately simple: no zigzag helper, no sorting tricks. It checks the invariants that do
    not depend on HOW a ring splits a sequence (coverage, ring agreement, orders, capacity,
    offload range, ranks in range); the split itself is checked against PIECES_BY_HAND above.
    """
    problems = []
    n, cap, layers = d["hdp_size"], d["capacity"], d.get("layers_per_stage", 1)
    lengths = {}
    for s in d["sequences"]:
        if s["id"] in lengths or s["length"] < 1:
            problems.append(f"bad sequence {s}")
        lengths[s["id"]] = s["length"]
    if n < 1 or cap < 1 or d.get("pp_size", 1) < 1 or d.get("align", 1) < 1 or layers < 1:
        problems.append("sizes")
    if len(d["ranks"]) != n or [r["rank"] for r in d["ranks"]] != list(range(n)):
        problems.append("rank entries")
    owners: dict[int, list] = {}
    holders: dict[int, set] = {}
    for r in d["ranks"]:
        orders = [mb["order"] for mb in r["micro_batches"]]
        if any(b <= a for a, b in zip(orders, orders[1:])):
            problems.append(f"rank {r['rank']} orders {orders}")
        for mb in r["micro_batches"]:
            ring = tuple(mb["ring"])
            key = (ring, tuple(mb["seqs"]), mb["offload_ratio"])
            owners.setdefault(mb["order"], []).append(key)
            holders.setdefault(mb["order"], set()).add(r["rank"])
            if (not ring or len(set(ring)) != len(ring) or r["rank"] not in ring
                    or any(not 0 <= m < n for m in ring)):
                problems.append(f"ring {ring} on rank {r['rank']}")
            ratio = mb["offload_ratio"]
            if not (0.0 <= ratio <= 1.0):
                problems.append(f"offload ratio {ratio}")
            if not mb["seqs"] or any(s not in lengths for s in mb["seqs"]):
                problems.append(f"sequences {mb['seqs']}")
            tokens = sum(p["end"] - p["start"] for p in mb["pieces"])
            resident = tokens if layers <= 2 or ratio <= 0 else tokens * (2 + (1 - ratio) * (layers - 2)) / layers
            if resident > cap:
                problems.append(f"capacity: {resident} > {cap}")
            if any(p["seq"] not in mb["seqs"] for p in mb["pieces"]):
                problems.append("piece of a sequence the micro-batch does not carry")
            elif [mb["seqs"].index(p["seq"]) for p in mb["pieces"]] != sorted(
                    mb["seqs"].index(p["seq"]) for p in mb["pieces"]):
                problems.append("pieces not in the buffer order of seqs")
    for order, keys in owners.items():
        if len(set(keys)) != 1 or set(keys[0][0]) != holders[order]:
            problems.append(f"order {order} members disagree")
    seq_orders: dict[int, set] = {}
    for order, keys in owners.items():
        for sid in keys[0][1]:
            seq_orders.setdefault(sid, set()).add(order)
    problems += [f"sequence {s} in orders {o}" for s, o in seq_orders.items() if len(o) > 1]
    count: dict[tuple[int, int], int] = {}
    for r in d["ranks"]:
        for mb in r["micro_batches"]:
            for p in mb["pieces"]:
                for t in range(p["start"], p["end"]):
                    count[(p["seq"], t)] = count.get((p["seq"], t), 0) + 1
    expected = {(s, t) for s, length in lengths.items() for t in range(length)}
    if set(count) != expected or any(c != 1 for c in count.values()):
        problems.append("tokens not covered exactly once")
    return problems


# --------------------------------------------------------------------------- the rejection table
def _mb(d, rank, index):
    return d["ranks"][rank]["micro_batches"][index]


def _set_on_members(d, order, **fields):
    for r in d["ranks"]:
        for mb in r["micro_batches"]:
            if mb["order"] == order:
                mb.update(fields)


def swap_orders(d):  # rank 3 runs order 3 before order 1
    mbs = d["ranks"][3]["micro_batches"]
    mbs[0], mbs[1] = mbs[1], mbs[0]


def duplicate_order(d):  # rank 0's local pack reuses order 0
    _mb(d, 0, 1)["order"] = 0


def overlapping_pieces(d):  # rank 2's first piece starts one token early: token 5 twice
    _mb(d, 2, 0)["pieces"][0]["start"] = 5


def missing_token(d):  # rank 1's last piece of sequence 0 stops one token short: token 23 lost
    _mb(d, 1, 0)["pieces"][1]["end"] = 23


def missing_piece(d):  # rank 1 drops its second piece of sequence 0: tokens 18-23 lost
    del _mb(d, 1, 0)["pieces"][1]


def covered_twice_on_two_ranks(d):  # sequence 1 packed on rank 3 AND on rank 0
    mb = _mb(d, 0, 1)
    mb["seqs"].append(1)
    mb["pieces"].append({"seq": 1, "start": 0, "end": 5})


def covered_twice_in_one_micro_batch(d):  # sequence 4 twice in rank 0's pack (13 tokens)
    mb = _mb(d, 0, 1)
    mb["seqs"].append(4)
    mb["pieces"].append({"seq": 4, "start": 0, "end": 3})


def members_disagree_on_ring(d):  # rank 1 thinks order 0's ring is (0, 1, 2)
    _mb(d, 1, 0)["ring"] = [0, 1, 2]


def members_disagree_on_order(d):  # rank 2 holds sequence 0's ring micro-batch as order 5
    _mb(d, 2, 0)["order"] = 5


def member_lacks_micro_batch(d):  # rank 2 never runs order 0
    d["ranks"][2]["micro_batches"] = []


def members_disagree_on_offload(d):
    _mb(d, 2, 0)["offload_ratio"] = 0.5


def capacity_overflow(d):  # ranks 1 and 2 hold 12 tokens of order 0
    d["capacity"] = 11


def capacity_overflow_with_offload(d):
    # l = 8, r = 0.1: 12 * (2 + 0.9 * 6) / 8 = 11.1 token-equivalents > 10
    d["capacity"], d["layers_per_stage"] = 10, 8
    _set_on_members(d, 0, offload_ratio=0.1)


def unknown_sequence(d):  # rank 3's order 1 carries sequence 9, which the plan does not list
    mb = _mb(d, 3, 0)
    mb["seqs"], mb["pieces"] = [9], [{"seq": 9, "start": 0, "end": 5}]


def sequence_in_no_piece(d):
    d["sequences"].append({"id": 5, "length": 4})


def offload_above_one(d):
    _set_on_members(d, 0, offload_ratio=1.5)


def offload_negative(d):
    _set_on_members(d, 0, offload_ratio=-0.25)


def offload_nan(d):
    _set_on_members(d, 0, offload_ratio=math.nan)


def ring_outside_plan(d):  # order 3's ring names rank 4 of a 4-rank plan
    _set_on_members(d, 3, ring=[3, 4])


def ring_negative_rank(d):
    _set_on_members(d, 3, ring=[-1, 3])


def rank_not_in_its_ring(d):
    _mb(d, 2, 0)["ring"] = [0, 1, 3]


def ring_with_repeated_rank(d):
    _mb(d, 3, 0)["ring"] = [3, 3]


def empty_micro_batch(d):
    mb = _mb(d, 3, 0)
    mb["seqs"], mb["pieces"] = [], []


def rank_entries_out_of_order(d):
    d["ranks"][0], d["ranks"][1] = d["ranks"][1], d["ranks"][0]


def plan_size_differs_from_entries(d):
    d["hdp_size"] = 5


def duplicate_sequence_id(d):
    d["sequences"].append({"id": 1, "length": 5})


def empty_sequence(d):
    d["sequences"][1]["length"] = 0


def piece_of_a_sequence_not_carried(d):  # rank 0's pack holds tokens of sequence 1 it does not list
    _mb(d, 0, 1)["pieces"].append({"seq": 1, "start": 0, "end": 5})


def pieces_out_of_buffer_order(d):  # seqs say (2, 4), the pieces come as 4 then 2
    mb = _mb(d, 0, 1)
    mb["pieces"] = mb["pieces"][::-1]


def empty_piece(d):
    _mb(d, 2, 0)["pieces"][1] = {"seq": 0, "start": 24, "end": 24}


def _sizes(**fields):
    def edit(d):
        d.update(fields)
    edit.__name__ = "_".join(f"{k}_{v}" for k, v in fields.items())
    return edit


REJECTIONS = [
    (swap_orders, r"rank 3 micro-batch 1 \(order 1\): orders must increase on a rank \(previous 3\)"),
    (duplicate_order, r"rank 0 micro-batch 1 \(order 0\): orders must increase"),
    # a wrong piece breaks the split and the coverage; either message names the place
    (overlapping_pieces, r"rank 2 .*not the zigzag share|sequence 0: tokens 5-5 overlap"),
    (missing_token, r"rank 1 .*not the zigzag share|sequence 0: tokens 23-23 are (missing|in no piece)"),
    (missing_piece, r"rank 1 .*not the zigzag share|sequence 0: tokens 18-23 are (missing|in no piece)"),
    (covered_twice_on_two_ranks, r"sequence 1: pieces sit in micro-batches of orders (1 and 2|2 and 1)"),
    (covered_twice_in_one_micro_batch, r"sequence 4: tokens 0-2 overlap|appears twice"),
    (members_disagree_on_ring, r"ring \[0, 1, 2\] differs from another member's \[0, 2, 1\]"),
    (members_disagree_on_order, r"sequence 0: pieces sit in micro-batches of orders 0 and 5"
                                r"|order 0: ring members \[2\] have no such micro-batch"),
    (member_lacks_micro_batch, r"order 0: ring members \[2\] have no such micro-batch"),
    (members_disagree_on_offload, r"offload ratio or sequences differ between ring members"),
    (capacity_overflow, r"12 tokens with offload ratio 0.0 keep 12.0 token-equivalents resident, over capacity 11"),
    (capacity_overflow_with_offload, r"12 tokens with offload ratio 0.1 keep 11.1 token-equivalents resident, over capacity 10"),
    (unknown_sequence, r"rank 3 micro-batch 0 \(order 1\): unknown sequence 9"),
    (sequence_in_no_piece, r"sequence 5: tokens 0-3 are in no piece"),
    (offload_above_one, r"offload_ratio 1.5 must be in \[0, 1\]"),
    (offload_negative, r"offload_ratio -0.25 must be in \[0, 1\]"),
    (offload_nan, r"offload_ratio nan must be in \[0, 1\]"),
    (ring_outside_plan, r"ring \[3, 4\] names a rank outside \[0, 4\)"),
    (ring_negative_rank, r"ring \[-1, 3\] names a rank outside \[0, 4\)"),
    (rank_not_in_its_ring, r"rank 2 is not a member of its ring \[0, 1, 3\]"),
    (ring_with_repeated_rank, r"ring \[3, 3\] must be non-empty with distinct ranks"),
    (empty_micro_batch, r"rank 3 micro-batch 0 \(order 1\): carries no sequence"),
    (rank_entries_out_of_order, r"rank entry 0 says rank 1; entries must be in rank order"),
    (plan_size_differs_from_entries, r"plan has 4 rank entries for hdp_size 5"),
    (duplicate_sequence_id, r"sequence id 1 appears twice"),
    (empty_sequence, r"sequence 1: length 0 must be >= 1"),
    (piece_of_a_sequence_not_carried,
     r"^rank 0 micro-batch 1 \(order 2\): piece of sequence 1, which is not in seqs \[2, 4\]$"),
    (pieces_out_of_buffer_order,
     r"^rank 0 micro-batch 1 \(order 2\): pieces \[\(4, 0, 3\), \(2, 0, 7\)\] do not follow the order of seqs \[2, 4\]$"),
    (empty_piece, r"rank 2 micro-batch 0 \(order 0\): piece \[24, 24\) of sequence 0 is empty"),
    (_sizes(hdp_size=0), r"^hdp_size \(0\) must be >= 1$"),
    (_sizes(capacity=0), r"^capacity \(0\) must be >= 1$"),
    (_sizes(pp_size=0), r"^pp_size \(0\) must be >= 1$"),
    (_sizes(align=0), r"^align \(0\) and layers_per_stage \(1\) must be >= 1$"),
    (_sizes(layers_per_stage=0), r"^align \(2\) and layers_per_stage \(0\) must be >= 1$"),
]


@pytest.mark.parametrize("edit, message", REJECTIONS, ids=[e.__name__ for e, _ in REJECTIONS])
def test_validate_rejects(edit, message):
    d = valid_dict()
    edit(d)
    assert brute_force_problems(d), "the edit should break the plan (test bug)"
    plan = StepPlan.from_dict(d)  # well-formed JSON: only validate() may object
    with pytest.raises(PlanError, match=message):
        plan.validate()


def test_limits_are_inclusive():
    d = valid_dict()
    d["capacity"] = 12  # the fullest micro-batch holds exactly 12 tokens
    StepPlan.from_dict(d).validate()
    # one-token sequences on ranks of capacity 1
    b = PlanBuilder(hdp_size=2, capacity=1, lengths={0: 1, 1: 1})
    b.add([0], [0])
    b.add([1], [1])
    b.build(scheduler="hand").validate()


def test_offload_lets_a_micro_batch_exceed_capacity_within_eq3_budget():
    # 12 tokens, l = 8, r = 1: 12 * 2 / 8 = 3 token-equivalents resident (<= 11); r = 0.25: 9.75;
    # l = 3, r = 1: 12 * 2 / 3 = 8 (<= 10, and rank 0's pack of 10 fits exactly)
    for ratio, capacity, layers in ((1.0, 11, 8), (0.25, 10, 8), (1.0, 10, 3)):
        d = valid_dict()
        d["capacity"], d["layers_per_stage"] = capacity, layers
        _set_on_members(d, 0, offload_ratio=ratio)
        assert brute_force_problems(d) == []
        StepPlan.from_dict(d).validate()


def test_pipeline_members_must_share_the_local_index():
    b = PlanBuilder(hdp_size=2, capacity=100, lengths={0: 8, 1: 4, 2: 8})
    b.add([0, 1], [0])
    b.add([1], [1])  # rank 1 runs a local pack between the two rings
    b.add([1, 0], [2])  # ...so the second ring is at index 1 on rank 0, index 2 on rank 1
    b.build(scheduler="hand", pp_size=1).validate()
    with pytest.raises(PlanError, match=r"order 2: with pp_size 2 ring members must hold the "
                                         r"micro-batch at the same local index, got \{0: 1, 1: 2\}"):
        b.build(scheduler="hand", pp_size=2).validate()


def test_random_single_edits_are_rejected_exactly_when_the_brute_force_finds_a_problem():
    """Fuzz: random edits of one field; validate() raises PlanError (never another exception)
    whenever the independent checker finds a problem, and accepts every edit it finds none in.
    Edits that could yield another legitimate split of a ring (moving a piece boundary and its
    neighbour together) are not made, so the reference needs no zigzag rule."""
    rng = random.Random(12)
    base = valid_dict()
    fields = ("order", "ring", "offload_ratio", "seqs", "piece", "capacity", "length", "drop")
    rejected = accepted = 0
    for _ in range(400):
        d = copy.deepcopy(base)
        what = rng.choice(fields)
        rank = rng.randrange(4)
        mbs = d["ranks"][rank]["micro_batches"]
        mb = rng.choice(mbs) if mbs else None
        if what == "order" and mb:
            mb["order"] += rng.choice([-2, -1, 1, 2, 7])
        elif what == "ring" and mb:
            mb["ring"] = rng.sample(range(-1, 6), rng.randint(1, 3))
        elif what == "offload_ratio" and mb:
            mb["offload_ratio"] = rng.choice([-0.5, 0.5, 1.0, 1.01, math.inf])
        elif what == "seqs" and mb:
            mb["seqs"] = rng.sample(range(7), rng.randint(0, 2))
        elif what == "piece" and mb:
            p = rng.choice(mb["pieces"])
            p[rng.choice(["start", "end"])] += rng.choice([-2, -1, 1, 3])
        elif what == "capacity":
            d["capacity"] = rng.randint(1, 20)
        elif what == "length":
            s = rng.choice(d["sequences"])
            s["length"] += rng.choice([-1, 1])
        elif what == "drop" and mb:
            mbs.remove(mb)
        problems = brute_force_problems(d)
        plan = StepPlan.from_dict(json.loads(json.dumps(d)))
        if problems:
            with pytest.raises(PlanError):
                plan.validate()
            rejected += 1
        else:
            plan.validate()
            accepted += 1
    assert rejected > 250 and accepted > 10  # both branches were exercised


# --------------------------------------------------------------------------- malformed JSON
MALFORMED = [
    ("{", r"plan is not valid JSON"),
    ("[]", r"malformed plan: expected a JSON object, got list"),
    ("7", r"malformed plan: expected a JSON object, got int"),
    ("{}", r"malformed plan: missing field 'ranks'"),
]


def _json_with(edit) -> str:
    d = valid_dict()
    edit(d)
    return json.dumps(d)


def _set(path, value):
    def edit(d):
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


MALFORMED_FIELDS = [
    (_set(["version"], 2), r"plan version 2 is not supported \(expected 1\)"),
    (_set(["version"], "one"), r"version must be an integer, got 'one'"),
    (_set(["hdp_size"], 4.5), r"hdp_size must be an integer, got 4.5"),
    (_set(["capacity"], True), r"capacity must be an integer, got True"),
    (_set(["ranks"], 4), r"ranks must be a list, got int"),
    (_set(["ranks", 0, "micro_batches"], "abc"), r"ranks\[0\].micro_batches must be a list"),
    (_set(["ranks", 0, "micro_batches", 0], [1, 2]), r"ranks\[0\].micro_batches\[0\] must be an object"),
    (_set(["ranks", 0, "micro_batches", 0, "order"], 1.5), r"ranks\[0\].micro_batches\[0\].order must be an integer, got 1.5"),
    (_set(["ranks", 0, "micro_batches", 0, "ring"], "021"), r"ranks\[0\].micro_batches\[0\].ring must be a list, got str"),
    (_set(["ranks", 0, "micro_batches", 0, "ring"], [0, "2", 1]), r"ring must be an integer, got '2'"),
    (_set(["ranks", 0, "micro_batches", 0, "offload_ratio"], "half"), r"offload_ratio must be a number, got 'half'"),
    (_set(["ranks", 0, "micro_batches", 0, "pieces"], {"seq": 0}), r"pieces must be a list, got dict"),
    (_set(["ranks", 0, "micro_batches", 0, "pieces", 0, "end"], 6.0), r"pieces\[0\].end must be an integer, got 6.0"),
    (_set(["ranks", 0, "micro_batches", 0, "pieces", 0], {"seq": 0, "start": 0}), r"missing field 'end'"),
    (_set(["sequences", 0, "length"], "30"), r"sequences\[0\].length must be an integer, got '30'"),
    (_set(["sequences"], [[0, 30]]), r"malformed plan: TypeError"),
    (_set(["estimate"], {"step_time_s": 1.0}), r"missing field 'rank_time_s'"),
    (_set(["meta"], [1, 2]), r"malformed plan: meta must be an object, got list"),
]


@pytest.mark.parametrize("text, message", MALFORMED)
def test_from_json_rejects_malformed_text(text, message):
    with pytest.raises(PlanError, match=message):
        StepPlan.from_json(text)


@pytest.mark.parametrize("edit, message", MALFORMED_FIELDS, ids=range(len(MALFORMED_FIELDS)))
def test_from_json_rejects_malformed_fields(edit, message):
    with pytest.raises(PlanError, match=message):
        StepPlan.from_json(_json_with(edit))


def test_round_trip_keeps_the_plan():
    plan = valid_plan()
    again = StepPlan.from_json(plan.to_json())
    assert again == plan and again.content_hash() == plan.content_hash()
    assert StepPlan.from_json(plan.to_json(indent=2)).validate() == plan
