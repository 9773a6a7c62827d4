"""Global batch sizes step by step, as Megatron-LM's training loop counts them.

Megatron's loop calls ``update_num_microbatches(consumed_train_samples)`` before every step
and then adds the step's global batch size to ``consumed_train_samples``; with
``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-LM 0.16.1) the size grows from START by
INCREMENT every ``SAMPLES / ((GLOBAL - START) / INCREMENT)`` consumed samples up to
``--global-batch-size``; Megatron-LM 0.19 ignores that flag and steps the size with
``--step-batch-size-schedule`` instead (``compat.megatron_batch_size_calculator`` builds the
calculator the installed Megatron uses).
An HDP global batch is a *token budget* (``global batch size x --seq-length``), so the data
iterator must know the size of every step before Megatron's loop reaches it: it plans ahead.
:class:`GlobalBatchSchedule` replays megatron-core's own calculator from sample 0 (same
arithmetic, same rounding, no copy of it), so step ``i``'s size here is the one the loop uses,
and a resumed run finds the step at which its checkpoint's ``consumed_train_samples`` stopped.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["GlobalBatchSchedule"]


class GlobalBatchSchedule:
    """The global batch size (samples) of every training step, ramp-up included."""

    def __init__(self, *, global_batch_size: int, micro_batch_size: int = 1,
                 data_parallel_size: int = 1,
                 rampup_batch_size: Optional[Sequence[int]] = None,
                 decrease_batch_size_if_needed: bool = False,
                 step_batch_size_schedule: Optional[str] = None,
                 seq_length: Optional[int] = None) -> None:
        from .compat import megatron_batch_size_calculator

        self.global_batch_size = int(global_batch_size)
        self.rampup = tuple(int(x) for x in rampup_batch_size) if rampup_batch_size else None
        self.step_schedule = step_batch_size_schedule
        # 0.16.1: --rampup-batch-size; 0.19: --step-batch-size-schedule (compat knows which)
        self._calculator: Any = megatron_batch_size_calculator(
            global_batch_size=self.global_batch_size, micro_batch_size=micro_batch_size,
            data_parallel_size=data_parallel_size,
            decrease_batch_size_if_needed=decrease_batch_size_if_needed,
            rampup_batch_size=self.rampup, step_batch_size_schedule=step_batch_size_schedule,
            seq_length=seq_length,
        )  # fmt: skip
        self._sizes: list[int] = []
        self._consumed: list[int] = [0]  # samples consumed before step i

    @classmethod
    def from_args(cls, args: Any, data_parallel_size: int) -> "GlobalBatchSchedule":
        """The schedule of Megatron's ``args`` (``--global-batch-size``, ``--rampup-batch-size``
        on 0.16.1, ``--step-batch-size-schedule`` on 0.19)."""
        return cls(global_batch_size=args.global_batch_size,
                   micro_batch_size=args.micro_batch_size,
                   data_parallel_size=data_parallel_size,
                   rampup_batch_size=getattr(args, "rampup_batch_size", None),
                   decrease_batch_size_if_needed=bool(
                       getattr(args, "decrease_batch_size_if_needed", False)),
                   step_batch_size_schedule=getattr(args, "step_batch_size_schedule", None),
                   seq_length=getattr(args, "seq_length", None))

    def _extend(self, steps: int) -> None:
        while len(self._sizes) < steps:
            self._calculator.update(self._consumed[-1], consistency_check=False)
            size = int(self._calculator.get_current_running_global_batch_size())
            self._sizes.append(size)
            self._consumed.append(self._consumed[-1] + size)

    def samples(self, step: int) -> int:
        """Global batch size of step ``step`` (0-based)."""
        self._extend(step + 1)
        return self._sizes[step]

    def consumed_before(self, step: int) -> int:
        """Samples consumed by steps ``0 .. step - 1``."""
        self._extend(step)
        return self._consumed[step]

    def steps_done(self, consumed_samples: int) -> int:
        """How many steps consumed exactly ``consumed_samples`` (a checkpoint's count).

        Raises:
            ValueError: the count falls inside a step of this schedule: the checkpoint was
                written with other batch-size flags.
        """
        consumed_samples = int(consumed_samples)
        step = 0
        while self.consumed_before(step) < consumed_samples:
            step += 1
        if self.consumed_before(step) != consumed_samples:
            raise ValueError(
                f"the checkpoint consumed {consumed_samples} training samples, which is not the "
                f"end of a step of --global-batch-size {self.global_batch_size}"
                f"{' with --rampup-batch-size ' + ' '.join(map(str, self.rampup)) if self.rampup else ''}"
                f"{' with --step-batch-size-schedule ' + repr(self.step_schedule) if self.step_schedule else ''}"
                f" (steps end at {self.consumed_before(step - 1)} and "
                f"{self.consumed_before(step)}); resume with the batch-size flags of the run "
                "that wrote the checkpoint"
            )
        return step
