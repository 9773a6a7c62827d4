"""The hooks a patched Megatron-LM (tag ``core_v0.16.1`` or ``core_v0.19.0``) calls for HDP.

``patches/megatron-lm-core_v0.16.1.patch`` and ``patches/megatron-lm-core_v0.19.0.patch`` add a
few calls into this module and nothing else; with ``--bytescale-hdp`` off every hook hands back
Megatron's own behaviour unchanged (and :func:`check_args` refuses other ``--bytescale-*`` flags
given without it, which would be ignored):

* ``pretrain_gpt.py`` passes its dataset provider, GPT builder, forward step and extra-args
  provider through :func:`wrap_datasets_provider`, :func:`wrap_model_builder`,
  :func:`wrap_forward_step` and :func:`chain_extra_args_provider` (which also refuses an
  unsupported Megatron version, at start-up); on core_v0.19, whose ``pretrain`` builds the model
  from a config container, the container goes through :func:`wrap_config_container` too;
* ``arguments.validate_args`` starts with :func:`check_args` (refuse what HDP cannot serve,
  naming the flag) and ends with :func:`validate_args` (turn on
  ``--calculate-per-token-loss``, fill capacity and context defaults). Both check every
  argument and report every refusal at once, printed by rank 0 only, then exit with status 2
  on every rank (no traceback per rank); :func:`hdp_refusals` returns the same list;
* ``training.train`` and ``training.evaluate`` use :func:`hdp_forward_backward` as their
  ``forward_backward_func``. ``train_step`` calls it once per step with Megatron's fixed
  ``num_microbatches``; it takes the step's plan from the data iterator instead and runs *this*
  rank's planned micro-batches (any number, zero included), then returns the per-micro-batch
  ``[loss_sum, tokens]`` reports that ``train_step`` all-reduces over the data-parallel (= HDP)
  group into the loss averaged over the global batch's tokens.

The step lives in :mod:`.megatron_lm_step`, the data in :mod:`.megatron_lm_data`; this
module is the one the patch imports. ``megatron.training`` exists only in a Megatron-LM
checkout (not in the megatron-core wheel), so it is imported inside functions, and only by the
hooks that need Megatron's global args.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Iterator, Optional

from ..env import MAX_PROCESSES, env_int
from .compat import megatron_lm_flag_refusals
from .config import ByteScaleConfig, RefusedArguments, add_bytescale_args, flag_name, given_flags
from .groups import HDPParallelLayout
from .moe import moe_refusals
from .planning import seq_split_refusals
from .megatron_lm_data import blend_weights, build_hdp_data_iterators
from .megatron_lm_step import forward_step, hdp_forward_backward, hdp_manager, megatron_args

__all__ = [
    "build_hdp_data_iterators",
    "build_hdp_gpt_model",
    "chain_extra_args_provider",
    "check_args",
    "extra_args_provider",
    "flags_without_hdp",
    "forward_step",
    "hdp_forward_backward",
    "hdp_refusals",
    "validate_args",
    "wrap_config_container",
    "wrap_datasets_provider",
    "wrap_forward_step",
    "wrap_model_builder",
]

logger = logging.getLogger(__name__)

ArgsProvider = Callable[[Any], Any]

# (attribute on Megatron's args, its flag, why HDP refuses it while it is set)
_UNEVEN_STAGES = ("the HDP planner's cost model puts the same number of layers on every "
                  "pipeline stage; split --num-layers evenly over --pipeline-model-parallel-size")
_REFUSED_FLAGS: tuple[tuple[str, str, str], ...] = (
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers", _UNEVEN_STAGES),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers", _UNEVEN_STAGES),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout", _UNEVEN_STAGES),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split",
     _UNEVEN_STAGES),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split",
     _UNEVEN_STAGES),
    ("ddp_average_in_collective", "--ddp-average-in-collective", "HDP normalises by the global "
     "token count (per-token loss), never by the number of ranks"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "HDP runs on Megatron DDP (+ ZeRO-1)"),
    ("use_torch_fsdp2", "--use-torch-fsdp2", "HDP runs on Megatron DDP (+ ZeRO-1)"),
    ("use_legacy_models", "--use-legacy-models", "HDP builds a megatron-core GPTModel"),
    ("spec", "--spec", "HDP builds its own layer spec (ByteScale core attention)"),
    ("mtp_num_layers", "--mtp-num-layers", "multi-token prediction is not supported with HDP"),
    ("multi_latent_attention", "--multi-latent-attention", "MLA is not supported with HDP"),
    ("experimental_attention_variant", "--experimental-attention-variant",
     "HDP replaces the core attention"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path",
     "HDP builds a uniform layer spec"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
     "its overlap interleaves two micro-batches' expert all-to-alls, which HDP's slots of "
     "different lengths do not pair up; leave it off"),
    ("sft", "--sft", "HDP plans documents from --data-path or --mock-data"),
    ("fim_data", "--fim-data", "HDP plans documents from --data-path or --mock-data"),
    ("train_data_path", "--train-data-path", "use --data-path (and --split)"),
    ("valid_data_path", "--valid-data-path", "use --data-path (and --split)"),
    ("test_data_path", "--test-data-path", "use --data-path (and --split)"),
    ("data_args_path", "--data-args-path", "use --data-path"),
    ("per_split_data_args_path", "--per-split-data-args-path", "use --data-path"),
    ("iterations_to_skip", "--iterations-to-skip", "skipping reads Megatron-format batches; "
     "HDP steps are whole planned global batches"),
    ("full_validation", "--full-validation", "HDP validates on token-budget global batches"),
    ("multiple_validation_sets", "--multiple-validation-sets", "one validation split only"),
)


# ----------------------------------------------------------------------------- flags


def extra_args_provider(parser: Any) -> Any:
    """Megatron's ``extra_args_provider``: adds the ``--bytescale-*`` flags."""
    return add_bytescale_args(parser)


def chain_extra_args_provider(other: Optional[ArgsProvider] = None) -> ArgsProvider:
    """An ``extra_args_provider`` that runs ``other`` (e.g. ModelOpt's) and then adds ours."""

    def provider(parser: Any) -> Any:
        _refuse_unsupported_megatron()  # the first hook pretrain_gpt.py calls: start-up
        if other is not None:
            parser = other(parser)
        return add_bytescale_args(parser)

    return provider


def _refuse_unsupported_megatron() -> None:
    """Exit with status 2 and one line naming the supported versions on an unsupported Megatron."""
    from .compat import UnsupportedMegatronVersion, require_supported_megatron

    try:
        require_supported_megatron()
    except UnsupportedMegatronVersion as exc:
        if _env_rank_is_zero():
            print(f"megatron_bytescale: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def check_args(args: Any) -> Optional[HDPParallelLayout]:
    """Refuse, naming the flag, what HDP cannot serve (None, and no check, without the flag).

    Called at the *start* of Megatron's ``validate_args``, so that a request for static CP,
    hybrid CP or PP gets this message rather than one of Megatron's own CP/PP assertions.
    Every refusal is reported at once by rank 0, then every rank exits with status 2.
    Without the flag, other ``--bytescale-*`` flags on the command line are refused too
    (:func:`flags_without_hdp`).
    """
    if not getattr(args, "bytescale_hdp", False):
        with _exit_on_refusal(args):
            reasons = flags_without_hdp(args)
            if reasons:
                raise RefusedArguments(reasons)
        return None
    with _exit_on_refusal(args):
        return _check_hdp_args(args)


def hdp_refusals(args: Any) -> list[str]:
    """Every reason ``--bytescale-hdp`` cannot run with Megatron's ``args`` (empty if it can).

    Checks what :func:`check_args` and :func:`validate_args` check, without changing ``args``.
    """
    if not getattr(args, "bytescale_hdp", False):
        return flags_without_hdp(args)
    try:
        _validated_config(args, explicit_capacity=True)
    except RefusedArguments as exc:
        return list(exc.reasons)
    return []


def flags_without_hdp(args: Any) -> list[str]:
    """The refusal of ``--bytescale-*`` flags given without ``--bytescale-hdp`` (empty if none).

    Without the switch Megatron trains without ByteScale and every other ByteScale flag would
    be ignored, so a user who forgot the switch would train plain Megatron without knowing.
    A flag counts as given when it is on the command line, whatever its value (the parser
    records it; a default value given explicitly counts). An explicit ``--no-bytescale-hdp``
    is a deliberate choice of plain Megatron (an A/B run on one command line): then the
    other flags are accepted and ignored.
    """
    given = given_flags(args)
    switch = (flag_name("hdp"), "--no-" + flag_name("hdp")[2:])
    if switch[1] in given:
        return []
    others = [flag for flag in given if flag not in switch]
    if not others:
        return []
    return [f"{', '.join(others)} given without {switch[0]}: Megatron would train without "
            f"ByteScale and ignore {'it' if len(others) == 1 else 'them'}; add {switch[0]} (or "
            f"{switch[1]} to run plain Megatron on purpose)"]


def _check_hdp_args(args: Any) -> HDPParallelLayout:
    """The layout, or :class:`RefusedArguments` listing every refused argument."""
    reasons: list[str] = []
    layout: Optional[HDPParallelLayout] = None
    try:
        layout = HDPParallelLayout.from_megatron_args(args)
    except RefusedArguments as exc:
        reasons += exc.reasons
    for attribute, flag, why in _REFUSED_FLAGS:
        if getattr(args, attribute, None):
            reasons.append(f"{flag} cannot be combined with --bytescale-hdp: {why}")
    if float(getattr(args, "attention_dropout", 0.0) or 0.0) > 0:
        reasons.append(
            f"--attention-dropout {args.attention_dropout} is not supported with --bytescale-hdp "
            "(the ring attention has no dropout); pass --attention-dropout 0.0"
        )
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none"):
        reasons.append(f"--cuda-graph-impl {args.cuda_graph_impl} cannot be combined with "
                       "--bytescale-hdp: micro-batch shapes change every step")
    if getattr(args, "transformer_impl", "local") == "inference_optimized":
        reasons.append("--transformer-impl inference_optimized cannot be used for HDP training")
    reasons += moe_refusals(args, layout_checked=True)  # the layout refuses the expert sizes
    reasons += _virtual_stage_refusals(args) + seq_split_refusals(args)
    reasons += _data_flag_refusals(args)
    reasons += megatron_lm_flag_refusals(args)  # what only this Megatron-LM version refuses
    if reasons or layout is None:
        raise RefusedArguments(reasons)
    return layout


def _virtual_stage_refusals(args: Any) -> list[str]:
    """What interleaved stages (``pipeline_interleaved``) do not run with under HDP."""
    from .groups import virtual_stages_from_args

    vpp = virtual_stages_from_args(args)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if vpp in (None, 1) or pp == 1:  # PP 1: the layout refuses virtual stages
        return []
    said = f"interleaved pipeline stages ({vpp} virtual stages)"
    reasons = [f"{flag} cannot be combined with {said} under --bytescale-hdp; drop one of them"
               for attribute, flag in (("overlap_grad_reduce", "--overlap-grad-reduce"),
                                       ("bytescale_offload", "--bytescale-offload"))
               if getattr(args, attribute, False)]
    if pp == 2 and getattr(args, "overlap_p2p_comm", True) is False:
        reasons.append(f"--no-overlap-p2p-communication cannot be combined with {said} at "
                       "--pipeline-model-parallel-size 2 (Megatron-LM asserts PP > 2 then; the HDP "
                       "driver sends without batching either way); drop that flag")
    return reasons


def validate_args(args: Any) -> ByteScaleConfig:
    """Check and complete Megatron's ``args`` for ``--bytescale-hdp`` (no-op without it).

    Called at the *end* of Megatron's ``validate_args`` (after it derived ``seq_length`` and
    friends). Runs :func:`check_args`, then sets ``calculate_per_token_loss`` (ranks train
    different numbers of tokens), ``dataloader_type = 'external'`` (the data comes from
    :func:`build_hdp_data_iterators`) and the capacity / context defaults, and checks them.
    Every refusal is reported at once by rank 0, then every rank exits with status 2.
    """
    if not getattr(args, "bytescale_hdp", False):
        check_args(args)  # refuses ByteScale flags given without the switch
        return ByteScaleConfig(hdp=False)
    explicit_capacity = args.bytescale_capacity is not None
    with _exit_on_refusal(args):
        config = _validated_config(args, explicit_capacity=explicit_capacity)
    if not args.calculate_per_token_loss:
        logger.info("--bytescale-hdp turns on --calculate-per-token-loss")
        args.calculate_per_token_loss = True
    if args.dataloader_type not in (None, "single", "external"):
        logger.warning("--bytescale-hdp replaces --dataloader-type %s with its own global-batch "
                       "iterator", args.dataloader_type)
    args.dataloader_type = "external"
    from .megatron_lm_metrics import explain_micro_batch_count

    explain_micro_batch_count()  # Megatron's "constant N micro-batches" line is not what runs
    if not explicit_capacity:
        logger.warning(
            "%s defaults to --seq-length (%s): every document fits on one rank, so HDP only "
            "packs; set it below the context length to split long documents over rings",
            flag_name("capacity"), config.capacity,
        )  # fmt: skip
    seq_length = getattr(args, "seq_length", None)
    if explicit_capacity and seq_length and config.capacity > int(seq_length) and _is_rank0(args):
        logger.warning(
            "%s (%d) is larger than --seq-length (%s): no sequence is longer than one rank's "
            "capacity, so no ring ever forms and HDP only packs short sequences together. Set "
            "it below --seq-length to split long sequences over rings",
            flag_name("capacity"), config.capacity, seq_length,
        )  # fmt: skip
    args.bytescale_capacity = config.capacity
    args.bytescale_context_length = config.context_length
    return config


def _validated_config(args: Any, *, explicit_capacity: bool) -> ByteScaleConfig:
    """The config of ``args`` after every check; :class:`RefusedArguments` lists all failures."""
    reasons: list[str] = []
    layout: Optional[HDPParallelLayout] = None
    try:
        layout = _check_hdp_args(args)
    except RefusedArguments as exc:
        reasons += exc.reasons
    config: Optional[ByteScaleConfig] = None
    try:
        config = ByteScaleConfig.from_args(args)
    except ValueError as exc:
        reasons.append(str(exc))
    if config is not None:
        try:
            capacity, context = config.require_capacity(), int(config.context_length or 0)
        except ValueError as exc:
            reasons.append(str(exc))
        else:
            if layout is not None and not config.offload and context > capacity * layout.hdp_size:
                reasons.append(
                    f"{flag_name('context_length')} {context} needs {-(-context // capacity)} "
                    f"ranks of {flag_name('capacity')} {capacity} tokens, but there are "
                    f"{layout.hdp_size} HDP ranks; raise the capacity, use more ranks or shorten "
                    "the context"
                )
            if config.dataloader == "ray":
                reasons += _ray_refusals()
            if config.ranks_per_node is None:  # the node map comes from LOCAL_WORLD_SIZE
                try:
                    env_int("LOCAL_WORLD_SIZE", low=1, high=MAX_PROCESSES,
                            hint="torchrun sets it to the processes per node; fix or unset it, "
                                 f"or pass {flag_name('ranks_per_node')} with the processes per node")
                except ValueError as exc:
                    reasons.append(str(exc))
            max_positions = getattr(args, "max_position_embeddings", None)
            if max_positions is not None and context > max_positions:
                reasons.append(
                    f"{flag_name('context_length')} {context} is longer than "
                    f"--max-position-embeddings {max_positions}: tokens are placed at their "
                    "position in the original document"
                )
    if reasons or config is None:
        raise RefusedArguments(reasons)
    return config


def _ray_refusals() -> list[str]:
    """``--bytescale-dataloader ray`` without Ray: say so before training starts."""
    from megatron_bytescale.data.ray_loader import RayUnavailableError, check_ray_available

    try:
        check_ray_available()  # not imported: a joining rank must set Ray's environment first
    except RayUnavailableError as exc:
        return [str(exc)]
    return []


def _is_rank0(args: Any) -> bool:
    rank = getattr(args, "rank", None)
    return _env_rank_is_zero() if rank is None else int(rank) == 0


def _env_rank_is_zero() -> bool:
    """Whether this process reports for the job: ``RANK`` 0 or unset. A ``RANK`` that is not a
    rank reports too (each such process prints the one line; none raises over it)."""
    try:
        return not env_int("RANK", low=0, high=MAX_PROCESSES, default=0)
    except ValueError:
        return True


@contextlib.contextmanager
def _exit_on_refusal(args: Any) -> Iterator[None]:
    """Turn :class:`RefusedArguments` into one report on rank 0 and exit status 2 everywhere.

    The hooks run on every rank before ``torch.distributed`` is up, so an exception would
    print one traceback per rank; the report is the same on every rank, so rank 0 prints it.
    """
    try:
        yield
    except RefusedArguments as exc:
        if _is_rank0(args):
            print(f"megatron_bytescale: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _data_flag_refusals(args: Any) -> list[str]:
    if getattr(args, "mock_data", False):
        return []
    if not getattr(args, "data_path", None):
        return ["--bytescale-hdp needs --data-path [WEIGHT] PREFIX [[WEIGHT] PREFIX ...] or "
                "--mock-data"]
    try:
        blend_weights(args)  # a weighted blend: valid weights (shares of tokens)
    except ValueError as exc:
        return [str(exc)]
    return []


# ----------------------------------------------------------------------------- groups, model


def wrap_model_builder(megatron_builder: Callable[..., Any]) -> Callable[..., Any]:
    """The GPT builder for ``model_provider``: ours with ``--bytescale-hdp``, else Megatron's."""

    @functools.wraps(megatron_builder)
    def builder(args, pre_process=True, post_process=True, vp_stage=None, config=None,
                pg_collection=None):
        build = build_hdp_gpt_model if getattr(args, "bytescale_hdp", False) else megatron_builder
        return build(args, pre_process, post_process, vp_stage, config=config,
                     pg_collection=pg_collection)

    return builder


def wrap_config_container(container: Any) -> Any:
    """Megatron-LM 0.19's ``PretrainConfigContainer`` for ``pretrain``: model left to us with HDP.

    From core_v0.19 ``pretrain_gpt.py`` builds the model from ``container.model`` (a GPT model
    config) and uses ``model_provider`` only when that is None. With ``--bytescale-hdp`` a copy
    without the model config is returned, so ``pretrain`` calls the ``model_provider`` the patch
    passes (:func:`wrap_model_builder`: the ByteScale GPT); otherwise ``container`` as is.
    """
    args_ = megatron_args()
    if args_ is None or not getattr(args_, "bytescale_hdp", False):
        return container
    import copy

    hdp_container = copy.copy(container)
    hdp_container.model = None
    return hdp_container


def build_hdp_gpt_model(args: Any, pre_process: bool = True, post_process: bool = True,
                        vp_stage: Optional[int] = None, *, config: Any = None,
                        pg_collection: Any = None) -> Any:
    """``ByteScaleGPTModel`` on Megatron's GPT layer spec with ``ByteScaleCoreAttention``.

    Takes the same arguments as Megatron's ``gpt_builder``; ``config`` defaults to
    ``core_transformer_config_from_args(args)``.
    """
    from .layer_spec import get_bytescale_layer_spec
    from .model import ByteScaleGPTModel

    hdp_manager(args)
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec_kwargs: dict[str, Any] = dict(qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
                                       qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)))
    if not use_te:
        spec_kwargs["normalization"] = args.normalization
    if getattr(args, "num_experts", None):
        spec_kwargs.update(num_experts=args.num_experts,
                           moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
    spec = get_bytescale_layer_spec(use_transformer_engine=use_te, **spec_kwargs)
    return ByteScaleGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


# ----------------------------------------------------------------------------- data, step


def wrap_datasets_provider(megatron_provider: Callable[..., Any]) -> Callable[..., Any]:
    """The dataset provider for ``pretrain``: HDP data iterators with ``--bytescale-hdp``.

    With ``dataloader_type == 'external'`` (set by :func:`validate_args`) Megatron wraps what
    the provider returns in ``RerunDataIterator`` as is, so each ``next()`` yields an
    ``HDPStep`` (the whole planned global batch) for :func:`hdp_forward_backward`.
    """

    @functools.wraps(megatron_provider)
    def provider(*args: Any, vp_stage: Optional[int] = None, **kwargs: Any) -> Any:
        args_ = megatron_args()
        if args_ is not None and getattr(args_, "bytescale_hdp", False):
            # interleaved stages: Megatron asks once per model chunk; the step reads chunk 0's
            return build_hdp_data_iterators(args_) if not vp_stage else (None, None, None)
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        return megatron_provider(*args, **kwargs)

    return provider


def wrap_forward_step(megatron_forward_step: Callable[..., Any]) -> Callable[..., Any]:
    """``forward_step`` for ``pretrain``: :func:`forward_step` with ``--bytescale-hdp``."""

    @functools.wraps(megatron_forward_step)
    def dispatch(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        args_ = megatron_args()
        if args_ is not None and getattr(args_, "bytescale_hdp", False):
            return forward_step(data_iterator, model, *args, **kwargs)
        return megatron_forward_step(data_iterator, model, *args, **kwargs)

    return dispatch
