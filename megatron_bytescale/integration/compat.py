"""The one place that knows how megatron-core and Megatron-LM differ between versions (D9).

Supported: megatron-core / Megatron-LM **0.16.1** (tag ``core_v0.16.1``; Python 3.10-3.11, the
newest release that installs there) and **0.19.x** (tag ``core_v0.19.0``; Python 3.12+). The
version is read from ``megatron.core.package_info`` (for a Megatron-LM checkout on
``PYTHONPATH`` that is the checkout's own ``megatron/core``), never guessed from which imports
work. Anything else is refused at start-up by :func:`require_supported_megatron`, with the list.

What differs, and who asks here (callers never check versions themselves):

* ``schedules.backward_step`` lost its ``model_type`` argument after 0.16
  (:func:`megatron_backward_step`);
* Megatron-LM's ``pretrain_gpt.py`` builds the model from a config container
  (``gpt_config_from_args``) in 0.19, from ``model_provider`` in 0.16.1: the patch for each tag
  hands the plugin's builder over its own way (:func:`megatron_lm_patch_tag` names the patch);
* megatron-core 0.19 ships its own dynamic ("hybrid") context-parallel scheduler, the baseline
  row of ``bytescale plan --compare`` (:func:`has_megatron_hybrid_cp_scheduler`);
* the batch-size ramp-up: ``--rampup-batch-size`` on 0.16.1, ``--step-batch-size-schedule`` on
  0.19, whose loop ignores the former (:func:`megatron_batch_size_calculator`,
  :func:`batch_size_ramp_flags`, :func:`megatron_lm_flag_refusals`), and 0.19's
  ``--eval-global-batch-size`` (:func:`evaluation_global_batch_size`);
* MoE experts on the local spec with ``moe_grouped_gemm``: 0.16.1 builds the legacy
  ``GroupedMLP`` (needs the ``grouped_gemm`` package), 0.19 always ``SequentialMLP``
  (:func:`local_spec_grouped_gemm_ok`); 0.16.1's MoE router needs Transformer Engine unless
  :func:`enable_moe_router_without_te` names its missing fallback switch.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # only annotations: ``bytescale plan`` asks for the version without torch
    import torch

#: (major, minor) -> (the oldest patch release supported, the Megatron-LM tag of its patch)
SUPPORTED_MEGATRON = {(0, 16): (1, "core_v0.16.1"), (0, 19): (0, "core_v0.19.0")}


class UnsupportedMegatronVersion(RuntimeError):
    """megatron-core / Megatron-LM at a version the plugin was not built and tested for."""


def supported_megatron_versions() -> str:
    """The supported versions as users read them: ``0.16.1 (core_v0.16.1), 0.19.x (...)``."""
    parts = []
    for (major, minor), (patch, tag) in sorted(SUPPORTED_MEGATRON.items()):
        shown = f"{major}.{minor}.{patch}" if (major, minor) == (0, 16) else f"{major}.{minor}.x"
        parts.append(f"{shown} (Megatron-LM {tag})")
    return ", ".join(parts)


def parse_megatron_version(text: str) -> tuple[int, int, int]:
    """``"0.19.1rc0"`` -> ``(0, 19, 1)``; a string that is not ``MAJOR.MINOR.PATCH...`` raises."""
    match = re.match(r"^\s*(\d+)\.(\d+)\.(\d+)", str(text))
    if match is None:
        raise UnsupportedMegatronVersion(
            f"cannot read the megatron-core version {text!r} (megatron.core.package_info); "
            f"megatron_bytescale supports {supported_megatron_versions()}"
        )
    return int(match[1]), int(match[2]), int(match[3])


@lru_cache(maxsize=1)
def megatron_core_version() -> tuple[int, int, int]:
    """The version of the ``megatron.core`` that imports here, from its ``package_info``.

    Read from the module ``megatron.core.package_info`` when megatron.core is already imported;
    otherwise that one file is run on its own, so asking (``bytescale plan --compare``) does not
    import all of megatron.core and torch. Raises :class:`UnsupportedMegatronVersion` when
    there is no megatron.core.
    """
    module = sys.modules.get("megatron.core.package_info")
    if module is None:
        spec = importlib.util.find_spec("megatron.core") if importlib.util.find_spec(
            "megatron") is not None else None
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        info = [Path(p) / "package_info.py" for p in locations
                if (Path(p) / "package_info.py").is_file()]
        if not info:
            raise UnsupportedMegatronVersion(
                f"megatron-core is not installed; megatron_bytescale supports "
                f"{supported_megatron_versions()}")
        file_spec = importlib.util.spec_from_file_location("_megatron_core_package_info", info[0])
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)  # type: ignore[union-attr]
    return parse_megatron_version(module.__version__)


def require_supported_megatron(version: Optional[tuple[int, int, int]] = None
                               ) -> tuple[int, int, int]:
    """``version`` (default: the installed one) if supported, else a one-line refusal.

    Raises :class:`UnsupportedMegatronVersion` naming the version found, the supported list and
    what to do.
    """
    found = megatron_core_version() if version is None else tuple(version)
    entry = SUPPORTED_MEGATRON.get(tuple(found[:2]))
    if entry is None or found[2] < entry[0]:
        shown = ".".join(map(str, found))
        raise UnsupportedMegatronVersion(
            f"megatron-core / Megatron-LM {shown} is not supported; megatron_bytescale supports "
            f"{supported_megatron_versions()}. Install a supported megatron-core "
            "(scripts/setup_env.sh picks the one for your Python) or check out a supported "
            "Megatron-LM tag"
        )
    return found  # type: ignore[return-value]


def megatron_lm_patch_tag(version: Optional[tuple[int, int, int]] = None) -> str:
    """The Megatron-LM tag whose patch fits ``version`` (default: the installed megatron-core)."""
    found = require_supported_megatron(version)
    return SUPPORTED_MEGATRON[tuple(found[:2])][1]


def is_megatron_019(version: Optional[tuple[int, int, int]] = None) -> bool:
    """True on megatron-core 0.19.x (the config-container ``pretrain``, hybrid CP scheduler)."""
    return tuple(require_supported_megatron(version)[:2]) >= (0, 19)


def megatron_backward_step(
    output_tensor: torch.Tensor,
    model: Any,
    config: Any,
    *,
    input_tensor: Optional[torch.Tensor] = None,
    output_tensor_grad: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Backward of one micro-batch through ``schedules.backward_step``.

    On the last stage (PP = 1 included) ``output_tensor`` is the loss and there is no
    ``output_tensor_grad``; on other stages it is the stage's output and the gradient came
    from the next stage. Returns the gradient of ``input_tensor`` (None on the first stage).
    """
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_type

    if megatron_core_version() < (0, 17, 0):  # 0.16.1: (..., model_type, config)
        return schedules.backward_step(
            input_tensor, output_tensor, output_tensor_grad, get_model_type(model), config
        )
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def megatron_forward_step(
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    *,
    num_microbatches: int,
    forward_data_store: list,
    config: Any,
    is_first_microbatch: bool,
    current_microbatch: int,
    input_tensor: Optional[torch.Tensor] = None,
    is_last_stage: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward through ``schedules.forward_step`` (CP size 1: rings are the plugin's).

    ``input_tensor`` is what the previous pipeline stage sent (None on the first stage); the
    loss is computed on the last stage only.
    """
    from megatron.core.pipeline_parallel import schedules

    return schedules.forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        1,  # cp_group_size: Megatron's CP is 1 under HDP; rings are the plugin's
        is_first_microbatch=is_first_microbatch,
        current_microbatch=current_microbatch,
        is_last_stage=is_last_stage,
    )


def has_megatron_hybrid_cp_scheduler() -> bool:
    """True where megatron-core ships its hybrid CP scheduler (0.19.x; not 0.16.1); an
    unsupported version raises :class:`UnsupportedMegatronVersion`."""
    return require_supported_megatron() >= (0, 19, 0)


# ----------------------------------------------------------------------------- batch sizes
# Megatron-LM 0.16.1 grows the global batch with --rampup-batch-size START INCREMENT SAMPLES;
# 0.19 still parses that flag but ignores it (deprecated) and ramps with
# --step-batch-size-schedule "THRESHOLD:SIZE ..." (thresholds in tokens), which must not be
# combined with --global-batch-size.


def megatron_batch_size_calculator(*, global_batch_size: int, micro_batch_size: int,
                                   data_parallel_size: int,
                                   decrease_batch_size_if_needed: bool = False,
                                   rampup_batch_size: Optional[Any] = None,
                                   step_batch_size_schedule: Optional[str] = None,
                                   seq_length: Optional[int] = None) -> Any:
    """megatron-core's own calculator of the global batch size, as Megatron-LM's loop builds it.

    Raises ValueError for a flag this Megatron-LM does not act on (the message names it and
    what to use instead), so that HDP never plans batches the loop will not count.
    """
    from megatron.core import num_microbatches_calculator as calculators

    common = dict(micro_batch_size=int(micro_batch_size),
                  data_parallel_size=int(data_parallel_size),
                  decrease_batch_size_if_needed=bool(decrease_batch_size_if_needed),
                  rank=-1)  # rank -1: logs nothing (Megatron's own calculator does)
    if megatron_core_version() < (0, 17, 0):
        if step_batch_size_schedule is not None:
            raise ValueError("--step-batch-size-schedule needs Megatron-LM core_v0.19; on "
                             "core_v0.16.1 ramp the batch with --rampup-batch-size")
        if rampup_batch_size:
            start, increment, samples = (int(x) for x in rampup_batch_size)
            return calculators.RampupBatchsizeNumMicroBatchesCalculator(
                global_batch_size=int(global_batch_size), start_global_batch_size=start,
                batch_size_increment=increment, ramup_samples=samples, **common,
            )  # fmt: skip
        return calculators.ConstantNumMicroBatchesCalculator(
            global_batch_size=int(global_batch_size), **common)
    if rampup_batch_size:
        raise ValueError(
            "--rampup-batch-size is ignored by Megatron-LM core_v0.19 (deprecated: its loop keeps "
            "the batch size constant), so HDP cannot follow it; ramp up with "
            "--step-batch-size-schedule instead (without --global-batch-size), e.g. "
            f"--step-batch-size-schedule \"{rampup_as_step_schedule(rampup_batch_size, global_batch_size, seq_length)}\""
        )
    if step_batch_size_schedule is not None:
        return calculators.StepBatchsizeNumMicroBatchesCalculator(
            schedule=str(step_batch_size_schedule),
            seq_length=int(seq_length) if seq_length else None, **common,
        )  # fmt: skip
    return calculators.ConstantNumMicroBatchesCalculator(
        global_batch_size=int(global_batch_size), **common)


def rampup_as_step_schedule(rampup_batch_size: Any, global_batch_size: int,
                            seq_length: Optional[int]) -> str:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as 0.19's ``--step-batch-size-schedule``.

    0.16.1 adds INCREMENT every ``SAMPLES / ((GLOBAL - START) / INCREMENT)`` consumed samples;
    the schedule lists the same steps, thresholds in tokens (``seq_length`` per sample) as
    Megatron-LM 0.19 reads them when it knows ``--seq-length`` (always, for GPT), else samples.
    """
    start, increment, samples = (int(x) for x in rampup_batch_size)
    steps = (int(global_batch_size) - start) // increment
    per_step = samples / steps if steps else 0
    scale = int(seq_length) if seq_length else 1
    entries = [(0, start)]
    for k in range(1, steps + 1):  # 0.16.1: size k from the first count >= k x per_step
        entries.append((math.ceil(k * per_step - 1e-9) * scale, start + k * increment))
    return " ".join(f"{threshold}:{size}" for threshold, size in entries)


def batch_size_ramp_settings(rampup_batch_size: Any, *, global_batch_size: int,
                             seq_length: Optional[int] = None) -> dict[str, Any]:
    """This ramp-up as keyword arguments of ``GlobalBatchSchedule`` (and of megatron-core's
    ``init_num_microbatches_calculator``) on the installed version: ``rampup_batch_size`` on
    0.16.1; on 0.19 the equivalent ``step_batch_size_schedule`` (thresholds in tokens when
    ``seq_length`` is given, else in samples) and ``seq_length``."""
    if megatron_core_version() < (0, 17, 0):
        return {"rampup_batch_size": [int(x) for x in rampup_batch_size]}
    return {"step_batch_size_schedule": rampup_as_step_schedule(
        rampup_batch_size, global_batch_size, seq_length), "seq_length": seq_length}


def batch_size_ramp_flags(rampup_batch_size: Any, *, global_batch_size: int,
                          seq_length: int) -> list[str]:
    """The Megatron-LM flags for this ramp-up on the installed version (docs, tests, launchers):
    ``--global-batch-size G --rampup-batch-size ...`` on 0.16.1; on 0.19 the equivalent
    ``--step-batch-size-schedule`` (which must not be given ``--global-batch-size``) and
    ``--eval-global-batch-size G``, so that evaluation batches stay G samples as on 0.16.1."""
    settings = batch_size_ramp_settings(rampup_batch_size, global_batch_size=global_batch_size,
                                        seq_length=seq_length)
    if "rampup_batch_size" in settings:
        return ["--global-batch-size", str(int(global_batch_size)), "--rampup-batch-size",
                *(str(x) for x in settings["rampup_batch_size"])]
    return ["--step-batch-size-schedule", settings["step_batch_size_schedule"],
            "--eval-global-batch-size", str(int(global_batch_size))]


def evaluation_global_batch_size(args: Any) -> int:
    """Samples per evaluation step: ``--eval-global-batch-size`` on 0.19 (it defaults to the
    global batch size there), ``--global-batch-size`` on 0.16.1 (no such flag)."""
    if megatron_core_version() >= (0, 17, 0) and getattr(args, "eval_global_batch_size", None):
        return int(args.eval_global_batch_size)
    return int(args.global_batch_size)


def megatron_lm_flag_refusals(args: Any) -> list[str]:
    """What ``--bytescale-hdp`` refuses on this Megatron-LM only (each names its flag)."""
    reasons: list[str] = []
    if megatron_core_version() >= (0, 17, 0) and getattr(args, "rampup_batch_size", None):
        try:
            megatron_batch_size_calculator(
                global_batch_size=int(getattr(args, "global_batch_size", None) or 1),
                micro_batch_size=1, data_parallel_size=1,
                rampup_batch_size=args.rampup_batch_size,
                seq_length=getattr(args, "seq_length", None))
        except ValueError as exc:
            reasons.append(str(exc))
    return reasons


def local_spec_grouped_gemm_ok() -> bool:
    """Whether megatron-core's *local* MoE spec can be asked for grouped GEMM here.

    0.16.1 then builds the legacy ``GroupedMLP``, which needs the ``grouped_gemm`` package;
    0.19's local spec builds ``SequentialMLP`` whatever it is asked, so asking is harmless.
    """
    if megatron_core_version() >= (0, 17, 0):
        return True
    from megatron.core.transformer.moe import grouped_gemm_util

    return bool(grouped_gemm_util.grouped_gemm_is_available())


def enable_moe_router_without_te() -> None:
    """Let megatron-core 0.16.1's MoE router run where Transformer Engine is missing.

    Its ``moe_utils`` defines ``te_general_gemm`` only when TE imports, yet the router's gating
    GEMM asks ``te_general_gemm is not None`` to choose its own ``torch.mm`` fallback, so
    without TE every MoE forward raises ``NameError``. Defining the name as None selects that
    fallback (0.19 defines it as None itself). Idempotent; nothing changes where TE imports.
    """
    if megatron_core_version() >= (0, 17, 0):
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_log_tracker_values(name: str) -> Optional["torch.Tensor"]:
    """The per-layer values megatron-core's MoE log tracker holds for ``name`` (None if none).

    0.16.1 keeps them in a dict of dicts (``get_moe_layer_wise_logging_tracker``); 0.19 in a
    ``MoEMetricsTracker`` (``get_moe_metrics_tracker().metrics``).
    """
    if megatron_core_version() >= (0, 17, 0):
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        entry = get_moe_metrics_tracker().metrics.get(name)
        return None if entry is None else entry.values
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(name)
    return None if entry is None else entry["values"]


def forget_moe_log_tracker() -> None:
    """Drop every entry of megatron-core's MoE log tracker (not only its values).

    The tracker sizes an entry by the layers of the first model that records it, so a process
    that builds a model with more MoE layers afterwards (the tests' references of several
    models) must start from an empty tracker. 0.16.1: the dict of dicts is emptied; 0.19: the
    global ``MoEMetricsTracker`` is destroyed (the next use creates a fresh one).
    """
    if megatron_core_version() >= (0, 17, 0):
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def clear_moe_log_tracker() -> None:
    """Zero every value of megatron-core's MoE log tracker, as Megatron-LM does after a log."""
    if megatron_core_version() >= (0, 17, 0):
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().clear()
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def report_moe_log(track_names: list[str], *, num_layers: int, loss_scale: float = 1.0
                   ) -> dict[str, float]:
    """What Megatron-LM's training log shows for the MoE losses ``track_names`` now: megatron-core's
    own reduction over ranks (pipeline stages, each value's reduce group), times ``loss_scale``,
    averaged over the layers. Collective over every rank; clears the tracker as the log does."""
    totals: dict[str, Any] = {}
    if megatron_core_version() >= (0, 17, 0):
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        get_moe_metrics_tracker().report(loss_scale=loss_scale, iteration=0,
                                         track_names=track_names, num_layers=num_layers,
                                         total_loss_dict=totals)
    else:
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        track_moe_metrics(loss_scale=loss_scale, iteration=0, total_loss_dict=totals,
                          track_names=track_names, num_layers=num_layers)
    return {name: float(totals[name]) for name in track_names if name in totals}
