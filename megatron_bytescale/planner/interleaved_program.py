"""What one pipeline stage does under interleaved (virtual) stages in training: its ops in the
template's order and the point-to-point messages around each, as plain data.

Why a separate, torch-free module. The training driver
(:mod:`megatron_bytescale.integration.pipeline_interleaved`) runs exactly this program on
megatron-core's ``P2PCommunicator``; the tests run the same program for every stage of random
HDP lists with blocking channels and ring rendezvous (``tests/planner/test_interleaved_program.py``)
to show that it cannot deadlock and that every message reaches the op that expects it, before
any torch code runs.

**Ops.** :func:`.pipeline_floor.template_stage_ops` with every pipeline's list length: the
interleaved schedule of the longest list rounded up to a multiple of ``p``, restricted to this
pipeline's local indices (ring members hold a ring at the same local index, so they run its ops
in one order). Model chunk ``c`` of stage ``s`` is virtual stage ``c p + s``.

**Messages.** A forward of chunk ``c`` on stage ``s`` sends its output to stage ``s + 1``
(chunk ``c``), or, on the last stage, round to stage 0 (chunk ``c + 1``); chunk ``v - 1`` of the
last stage computes the loss and sends nothing. A backward sends its input gradient to stage
``s - 1`` (chunk ``c``), or, on stage 0, round to the last stage (chunk ``c - 1``); chunk 0 of
stage 0 sends nothing. With the ranks of the pipeline group taken modulo ``p`` (as
``P2PCommunicator`` takes them), a forward always goes to the *next* rank and a backward to the
*previous* one.

**When.** A stage receives an op's input (forward) or output gradient (backward) right before
the op, and waits for it; it posts the op's message right after the op and does not wait for
it (the send completes in the background; the driver waits for all of them at the end of the
step). With sends that never block, a stage only ever waits for a message or a ring's
rendezvous, both of which follow the template's dependency graph, and that graph is acyclic
for every set of lists (:func:`.pipeline_floor.simulate_schedule` times it); so nothing waits
in a cycle. Pairing each send with the next receive in one blocking exchange, as today's 1F1B
driver does, is not enough here: with PP 2 and VPP 2, four micro-batches already deadlock when
sends wait for their receivers (the test runs both). Messages between two ranks are matched
first-in first-out (with PP 2 the next and the previous rank are one rank), and the test checks
that every one reaches the op that expects it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .pipeline_floor import template_stage_ops


@dataclass(frozen=True)
class StageOp:
    """One op of a stage: ``phase`` ``"F"`` | ``"B"`` of local micro-batch ``index`` through
    model chunk ``chunk``, what it receives before it runs and what it sends after."""

    phase: str
    index: int
    chunk: int
    receive: Optional[str]
    """``"prev"`` (a forward's input), ``"next"`` (a backward's output gradient) or None
    (chunk 0 of stage 0 forward; chunk ``v - 1`` of the last stage backward)."""
    send: Optional[str]
    """``"next"`` (a forward's output), ``"prev"`` (a backward's input gradient) or None."""

    def target(self, pp: int, vpp: int, stage: int) -> Optional[tuple[int, tuple[str, int, int]]]:
        """Where this op's message goes: ``(stage, (phase, index, chunk))`` of the op that
        receives it, or None."""
        if self.send is None:
            return None
        if self.phase == "F":
            wraps = stage == pp - 1
            return (stage + 1) % pp, ("F", self.index, self.chunk + wraps)
        wraps = stage == 0
        return (stage - 1) % pp, ("B", self.index, self.chunk - wraps)


def stage_program(lengths: Sequence[int], pp: int, vpp: int, stage: int) -> list[list[StageOp]]:
    """Per pipeline (of ``lengths`` micro-batches each), the ops of ``stage`` with their
    messages (module docstring)."""
    if pp < 2 or vpp < 1:
        raise ValueError(f"an interleaved program needs pp >= 2 and vpp >= 1 (got pp {pp}, vpp {vpp})")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside the pipeline's {pp} stages")
    first, last = stage == 0, stage == pp - 1
    out = []
    for ops in template_stage_ops(list(lengths), pp, vpp, stage):
        program = []
        for phase, index, chunk in ops:
            if phase == "F":
                receive = None if first and chunk == 0 else "prev"
                send = None if last and chunk == vpp - 1 else "next"
            else:
                receive = None if last and chunk == vpp - 1 else "next"
                send = None if first and chunk == 0 else "prev"
            program.append(StageOp(phase, index, chunk, receive, send))
        out.append(program)
    return out


__all__ = ["StageOp", "stage_program"]
