#!/usr/bin/env python
"""Content hashes of ``balance`` plans on seeded configurations, to show a speed change keeps
every plan and estimate identical.

Run it on the code before the change with ``--write FILE``, then after every change with
``--check FILE``: it names each configuration whose plan, estimate or meta differs. The hash
covers the whole plan JSON (ranks, rings, orders, offload ratios, pieces, the estimate's every
field and the meta: which candidate won, offload choice, widened units).

Configurations (124): toy batches on the toy cost model (GitHub and Byted, two seeds, DP,
PP 2 and 4, offload on and off, the regular node map, an irregular one, two-level rings;
expert groups at PP 1 and 2) and a few mid-size batches on the LLaMA-7B preset. ``--cells``
adds nine (seconds each): four real Fig. 17 PP cells, each planned with its estimate and
without (as the simulator plans), and DP-Balance at 1,024 ranks.

Usage: ``.venv/bin/python scripts/plan_hashes.py --write /tmp/hashes.json [--cells]`` then
``--check /tmp/hashes.json [--cells]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bytescale.data.synthetic import synthetic_lengths  # noqa: E402
from megatron_bytescale.planner.presets import preset_cost_model, toy_cost_model  # noqa: E402
from megatron_bytescale.planner.schedulers import make_plan  # noqa: E402
from megatron_bytescale.planner.topology import Topology  # noqa: E402


def _irregular(hdp: int) -> Topology:
    """Nodes of 3 and 5 ranks."""
    return Topology.from_node_map([r // 4 if r % 8 < 3 else r // 4 + 100 for r in range(hdp)])


def configurations(cells: bool) -> dict[str, callable]:
    """Name -> a function making the plan."""
    out = {}
    for ds in ("github", "byted"):
        for seed in (0, 1):
            for tokens, hdp, pp in ((60_000, 8, 1), (120_000, 16, 1), (60_000, 8, 2), (120_000, 8, 4),
                                    (400_000, 32, 2)):
                for offload in (False, True):
                    for nodes, two_level in ((None, False), ("irregular", False), (None, True)):
                        if tokens == 400_000 and (nodes, two_level) != (None, False):
                            continue
                        name = f"toy-{ds}-s{seed}-{tokens}-hdp{hdp}-pp{pp}-off{int(offload)}-{nodes}-2l{int(two_level)}"

                        def plan(ds=ds, seed=seed, tokens=tokens, hdp=hdp, pp=pp, offload=offload, nodes=nodes,
                                 two_level=two_level):
                            lengths = synthetic_lengths(ds, tokens, seed=seed, max_length=16_384)
                            topology = _irregular(hdp) if nodes == "irregular" else None
                            return make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=2_048,
                                             cost_model=toy_cost_model(two_level_ring=two_level), pp_size=pp,
                                             offload=offload, topology=topology, context_length=16_384)
                        out[name] = plan
            for ep, pp in ((2, 1), (4, 1), (2, 2)):
                name = f"toy-ep-{ds}-s{seed}-ep{ep}-pp{pp}"

                def plan(ds=ds, seed=seed, ep=ep, pp=pp):
                    lengths = synthetic_lengths(ds, 60_000, seed=seed, max_length=16_384)
                    return make_plan(lengths, scheduler="balance", hdp_size=8, capacity=2_048,
                                     cost_model=toy_cost_model(), ep_size=ep, pp_size=pp, offload=False,
                                     context_length=16_384)
                out[name] = plan
    cm7 = preset_cost_model("llama-7b")
    for ds in ("github", "byted"):
        for hdp, pp, offload in ((128, 1, False), (128, 1, True), (64, 2, True), (64, 4, False)):
            name = f"7b-{ds}-hdp{hdp}-pp{pp}-off{int(offload)}"

            def plan(ds=ds, hdp=hdp, pp=pp, offload=offload):
                lengths = synthetic_lengths(ds, 4 * 2**20, seed=0, max_length=262_144)
                return make_plan(lengths, scheduler="balance", hdp_size=hdp, capacity=8_192, cost_model=cm7,
                                 pp_size=pp, offload=offload, context_length=262_144)
            out[name] = plan
    if cells:
        from megatron_bytescale.sim import paper

        for model, ds, ctx in (("llama-70b", "github", 524_288), ("mistral-8x7b", "github", 262_144),
                               ("mistral-8x22b", "byted", 2_097_152), ("llama-70b", "byted", 1_048_576)):
            for estimate in (True, False):  # False: as the simulator plans (the estimate dropped)
                name = f"cell-{model}-{ds}-{ctx >> 10}K" + ("" if estimate else "-no-estimate")

                def plan(model=model, ds=ds, ctx=ctx, estimate=estimate):
                    setup = paper.paper_setup(model)
                    lengths = synthetic_lengths(ds, paper.GLOBAL_TOKENS, seed=0, max_length=ctx)
                    return make_plan(lengths, scheduler="balance", hdp_size=setup.hdp_size,
                                     capacity=setup.capacity, cost_model=setup.cost_model, pp_size=setup.pp_size,
                                     offload=True, overlong=setup.overlong, align=setup.align, context_length=ctx,
                                     delta=setup.delta, num_buckets=setup.num_buckets, pieces=False,
                                     topology=setup.topology, estimate=estimate)
                out[name] = plan
        name = "dp-github-256K-1024"

        def plan():
            lengths = synthetic_lengths("github", 32 * 2**20, seed=0, max_length=262_144)
            return make_plan(lengths, scheduler="balance", hdp_size=1024, capacity=8_192, cost_model=cm7,
                             context_length=262_144, offload=False)
        out[name] = plan
    return out


def plan_hash(plan) -> str:
    return hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True, default=repr).encode()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, help="store the hashes in this JSON file")
    group.add_argument("--check", type=Path, help="compare with the hashes stored in this JSON file")
    parser.add_argument("--cells", action="store_true", help="also four real Fig. 17 PP cells and DP at 1,024 ranks")
    args = parser.parse_args()
    t0 = time.process_time()
    hashes = {name: plan_hash(fn()) for name, fn in configurations(args.cells).items()}
    print(f"{len(hashes)} configurations planned in {time.process_time() - t0:.1f} s CPU")
    if args.write:
        args.write.write_text(json.dumps(hashes, indent=1, sort_keys=True))
        print(f"wrote {args.write}")
        return 0
    stored = json.loads(args.check.read_text())
    differ = [k for k in hashes if stored.get(k) != hashes[k]]
    if differ:
        print(f"{len(differ)} plans differ: {', '.join(differ)}")
        return 1
    print("all plans identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
