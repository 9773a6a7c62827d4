"""``scripts/bench_pipeline.py --vpp``: PP 2 x HDP 2 on 4 CPU ranks, PP-Balance planned with 1
and with 2 virtual (interleaved) stages per stage on the same batches, per-stage busy time and
bubbles measured beside the planner's estimate of the same plans.

The model, data, calibration and columns are those of part 1 of ``bench_pipeline.py`` (whose
``settings``, ``Probe`` and ``step_record`` this reuses), so the two sections read alike; the
4-layer model gives each stage two chunks of one layer with VPP 2. Writes section
``pipeline-vpp`` of docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench_pipeline import PP, WORLD, Probe, settings, step_record
from benchmarks_md import machine_line, markdown_table, write_section

VPP_SIZES = (1, 2)


def vpp_worker(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """PP 2 x HDP 2, PP-Balance, with 1 and with 2 virtual stages per stage on the same batches
    (the model of part 1: 4 layers, so 2 chunks of 1 layer per stage with VPP 2)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_bytescale.data.hdp_iterator import HDPDataIterator
    from megatron_bytescale.integration import (
        ByteScaleConfig,
        build_gpt_model,
        calibrate_cost_model,
        initialize_hdp_model_parallel,
        make_step_planner,
        make_transformer_config,
        run_hdp_step,
        seed_model_parallel,
        set_hdp_manager,
        wrap_for_hdp,
    )
    from megatron_bytescale.planner.estimate import simulate_plan
    from megatron_bytescale.runtime import CommCounters
    from megatron_bytescale.testing.cpu_compat import enable_cpu_megatron
    from megatron_bytescale.tools.demo_data import demo_global_batches

    enable_cpu_megatron()
    s = settings(steps)
    batches, _ = demo_global_batches("synthetic-byted", s)

    def model_config():
        return make_transformer_config(
            num_layers=s.num_layers, hidden_size=s.hidden_size,
            num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
            ffn_hidden_size=s.ffn_hidden_size, deallocate_pipeline_outputs=True,
        )  # fmt: skip

    manager = initialize_hdp_model_parallel()
    seed_model_parallel(s.seed)
    head_dim = s.hidden_size // s.num_attention_heads
    cost_model = calibrate_cost_model(
        build_gpt_model(model_config(), vocab_size=256, max_sequence_length=s.context_length),
        manager, lengths=s.effective_calibration_lengths,
        kv_bytes_per_token=2 * s.num_query_groups * head_dim * 4, vocab_size=256,
    ).cost_model  # fmt: skip
    probe = Probe()
    probe.install()
    out: dict[str, Any] = {"rank": rank, "cost_model": cost_model.name, "runs": {}}
    for vpp in VPP_SIZES:
        set_hdp_manager(None)
        parallel_state.destroy_model_parallel()
        layout = {"virtual_pipeline_model_parallel_size": vpp} if vpp > 1 else {}
        manager = initialize_hdp_model_parallel(pipeline_model_parallel_size=PP, **layout)
        seed_model_parallel(s.seed)
        rank_map = manager.rank_map
        out.update(pipeline=rank_map.hdp_rank, stage=rank_map.pp_rank)
        chunks = [build_gpt_model(model_config(), vocab_size=256, max_sequence_length=s.context_length,
                                  **({"vp_stage": c} if vpp > 1 else {})) for c in range(vpp)]
        ddps, optimizer = wrap_for_hdp(chunks if vpp > 1 else chunks[0], lr=s.lr)
        config = ByteScaleConfig(hdp=True, capacity=s.capacity, context_length=s.context_length,
                                 scheduler="balance")
        planner = make_step_planner(config, hdp_size=manager.size, cost_model=cost_model, pp_size=PP,
                                    vpp_size=vpp)
        records = []
        for index, step in enumerate(HDPDataIterator(batches, planner=planner, hdp=manager.hdp)):
            counters = CommCounters()
            dist.barrier()
            probe.take()
            record = run_hdp_step(step, model=ddps, optimizer=optimizer, manager=manager, counters=counters)
            spans = probe.take()
            if index == 0:
                continue  # warm-up
            _, sim = simulate_plan(step.plan, cost_model, record=True)
            records.append(step_record(step, record, counters, spans, sim, rank_map))
        out["runs"][vpp] = records
    return out


def vpp_table(results: list[dict[str, Any]]) -> tuple[str, dict[int, dict[str, float]]]:
    """Per VPP size and stage: measured busy / wait beside the estimate's busy / idle."""
    rows, summary = [], {}
    for vpp in VPP_SIZES:
        per_rank = {r["rank"]: r["runs"][vpp] for r in results}
        steps = len(next(iter(per_rank.values())))
        walls = [max(per_rank[rk][i]["step_wall_s"] for rk in per_rank) for i in range(steps)]
        est_step = statistics.mean(x["estimate_step_s"] for x in per_rank[0])
        summary[vpp] = {"wall": statistics.median(walls), "est_step": est_step,
                        "wait_share": [], "est_idle": []}
        for stage in range(PP):
            ranks = [r["rank"] for r in results if r["stage"] == stage]

            def mean_over_steps(key: str, rk: int) -> float:
                return statistics.mean(x[key] for x in per_rank[rk])

            busy = [mean_over_steps("busy_cpu_s", rk) for rk in ranks]
            wait = [mean_over_steps("p2p_wait_s", rk) + mean_over_steps("ring_wait_s", rk)
                    + mean_over_steps("reduce_wait_s", rk) for rk in ranks]
            wall = [mean_over_steps("step_wall_s", rk) for rk in ranks]
            est_busy = [mean_over_steps("estimate_busy_s", rk) for rk in ranks]
            share = statistics.mean(w / t for w, t in zip(wait, wall))
            idle = 1 - statistics.mean(est_busy) / est_step
            summary[vpp]["wait_share"].append(share)
            summary[vpp]["est_idle"].append(idle)
            counts = per_rank[ranks[0]][0]["counts"]
            rows.append([
                f"PP {PP} x VPP {vpp} x HDP {WORLD // PP}", stage, "/".join(str(c) for c in counts),
                f"{max(busy):.3f} / {statistics.mean(busy):.3f}", f"{statistics.mean(wait):.3f}",
                f"{100 * share:.0f} %", f"{statistics.median(walls):.3f}", f"{1e3 * est_step:.1f}",
                f"{1e3 * max(est_busy):.1f} / {1e3 * statistics.mean(est_busy):.1f}", f"{100 * idle:.0f} %",
            ])  # fmt: skip
    headers = ["layout", "stage", "micro-batches per pipeline (step 1)", "busy CPU s (max / mean)",
               "wait s", "wait share of step", "median step wall s", "est. step ms",
               "est. busy ms (max / mean)", "est. idle share"]
    return markdown_table(headers, rows), summary


def vpp_main(steps: int, write: bool) -> None:
    """Run the VPP comparison and write section ``pipeline-vpp`` of docs/benchmarks.md."""
    from megatron_bytescale.testing.distributed import run_distributed

    load_before = Path("/proc/loadavg").read_text().split()[0]
    print(f"PP {PP} x HDP {WORLD // PP}, VPP {VPP_SIZES}, {steps} steps each (+1 warm-up) ...", flush=True)
    t0 = time.time()
    results = run_distributed(WORLD, vpp_worker, steps, timeout_s=3600)
    print(f"  done in {time.time() - t0:.0f} s", flush=True)
    table, summary = vpp_table(results)
    load_after = Path("/proc/loadavg").read_text().split()[0]
    s = settings(steps)
    one, two = summary[1], summary[2]
    body = "\n".join([
        "## Pipeline parallelism with and without interleaved (virtual) stages "
        "(`scripts/bench_pipeline.py --vpp`)",
        "",
        machine_line() + f" Load average {load_before} before / {load_after} after: the 2-core box "
        "was shared with other jobs, so wall times are noisy.",
        "",
        f"PP {PP} x HDP {WORLD // PP} on {WORLD} CPU ranks, PP-Balance planned with `vpp_size` 1 and 2 on "
        f"the same batches: a {s.num_layers}-layer GPT (hidden {s.hidden_size}; with VPP 2 each stage holds "
        f"two chunks of {s.num_layers // (PP * 2)} layer), the Byted-like mix at C = {s.capacity} "
        f"({s.tokens_per_step:,} tokens per step), {steps} steps each after one warm-up, cost model "
        "calibrated on this model (`" + results[0]["cost_model"] + "`). Columns as in the pipeline "
        "section: busy = CPU time of the stage's forwards and backwards per step; wait = wall time "
        "blocked in stage-to-stage transfers, ring transfers and the gradient reduction (bubbles, "
        "plus waiting for a core); est. = the planner's simulation of the same plans (the "
        "interleaved template with VPP 2).",
        "",
        table,
        "",
        f"Estimated step: VPP 1 {1e3 * one['est_step']:.1f} ms, VPP 2 {1e3 * two['est_step']:.1f} ms "
        f"({one['est_step'] / two['est_step']:.2f}x); estimated idle share per stage "
        f"{', '.join(f'{100 * x:.0f} %' for x in one['est_idle'])} -> "
        f"{', '.join(f'{100 * x:.0f} %' for x in two['est_idle'])}. Measured median step wall: "
        f"VPP 1 {one['wall']:.3f} s, VPP 2 {two['wall']:.3f} s ({one['wall'] / two['wall']:.2f}x); "
        f"measured wait share per stage {', '.join(f'{100 * x:.0f} %' for x in one['wait_share'])} -> "
        f"{', '.join(f'{100 * x:.0f} %' for x in two['wait_share'])}.",
    ])
    print(body)
    if write:
        write_section("pipeline-vpp", body)
        print("wrote section 'pipeline-vpp' of docs/benchmarks.md")
