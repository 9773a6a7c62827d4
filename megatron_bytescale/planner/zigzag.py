"""Per-document zigzag split of a sequence over a ring (paper §7, "Dist-attn with Packing").

A sequence carried by a ring of N ranks is cut into 2N parts of equal *padded* size; the rank
at ring position i holds parts i and 2N-1-i. Causal attention then costs every member the same
(each covers 1/N of the mask area) and every member sends the same number of bytes.

Lengths rarely divide by 2N, so the sequence is padded up to a multiple of ``2N * align``: every
part has the padded size ``chunk`` and the padding sits at the end of the sequence, i.e. in the
highest parts. Padding tokens come after every real token, so under the causal mask no real token
ever attends to one; they are loss-masked and carry exactly zero gradient. ``align`` exists for
kernels that want each part to be a multiple of some tile (TE's THD format wants 2*cp | length).

Pieces in a plan hold real tokens only (a part that is all padding holds no piece).

The planner cuts parts of ``ceil(L / 2N)`` tokens, but nothing downstream depends on that: a plan
may state ANY contiguous split into 2N parts (an even one, say, with parts of ``L // 2N`` or
``L // 2N + 1`` tokens). :func:`zigzag_split_from_shares` recovers the 2N parts from what each ring
position holds, and :func:`padded_part_size` derives the padding from the largest part. Parts
that hold no token are allowed anywhere; a position then holds one piece or none.
"""

from __future__ import annotations

from typing import Sequence

Span = tuple[int, int]


def zigzag_chunk(length: int, ring_size: int, align: int = 1) -> int:
    """Padded size of each of the 2N parts of a sequence of ``length`` tokens."""
    if ring_size < 1:
        raise ValueError(f"ring_size ({ring_size}) must be >= 1")
    if align < 1:
        raise ValueError(f"align ({align}) must be >= 1")
    parts = 2 * ring_size
    per_part = -(-length // parts)  # ceil
    return -(-per_part // align) * align


def zigzag_parts(length: int, ring_size: int, align: int = 1) -> list[tuple[int, int]]:
    """The 2N parts as ``(start, end)`` ranges of real tokens; trailing parts may be empty."""
    chunk = zigzag_chunk(length, ring_size, align)
    return [
        (min(k * chunk, length), min((k + 1) * chunk, length)) for k in range(2 * ring_size)
    ]


def zigzag_part_ids(ring_size: int, position: int) -> tuple[int, int]:
    """The two part indices held by ring ``position``: ``(i, 2N-1-i)``."""
    if not 0 <= position < ring_size:
        raise ValueError(f"ring position ({position}) must be in [0, {ring_size})")
    return position, 2 * ring_size - 1 - position


def zigzag_share(
    length: int, ring_size: int, position: int, align: int = 1
) -> list[tuple[int, int]]:
    """Real-token ranges held by ring ``position``, non-empty ones only, in local order.

    A ring of size 1 holds the whole sequence as one range (no split, no padding).
    """
    if ring_size == 1:
        if position != 0:
            raise ValueError(f"ring position ({position}) must be 0 for a ring of size 1")
        return [(0, length)] if length > 0 else []
    chunk = zigzag_chunk(length, ring_size, align)
    out = []
    for part in zigzag_part_ids(ring_size, position):
        start, end = min(part * chunk, length), min((part + 1) * chunk, length)
        if end > start:
            out.append((start, end))
    return out


def zigzag_split(length: int, ring_size: int, align: int = 1) -> tuple[Span, ...]:
    """The planner's own split: :func:`zigzag_parts` as a tuple (``((0, length),)`` for N = 1)."""
    if ring_size == 1:
        return ((0, length),)
    return tuple(zigzag_parts(length, ring_size, align))


def even_zigzag_split(length: int, ring_size: int) -> tuple[Span, ...]:
    """A split into 2N parts as even as possible (the first ``L % 2N`` parts one token longer).

    Not what the planner cuts; a valid alternative that plans from other tools may state.
    """
    if ring_size == 1:
        return ((0, length),)
    parts, extra = divmod(length, 2 * ring_size)
    bounds = [0]
    for k in range(2 * ring_size):
        bounds.append(bounds[-1] + parts + (1 if k < extra else 0))
    return tuple(zip(bounds[:-1], bounds[1:]))


def zigzag_part_owner(part: int, ring_size: int) -> int:
    """The ring position holding part ``part`` of ``2N``: ``part`` or ``2N-1-part``."""
    return part if part < ring_size else 2 * ring_size - 1 - part


def zigzag_split_from_shares(length: int, shares: Sequence[Sequence[Span]]) -> tuple[Span, ...]:
    """The 2N contiguous parts of a sequence, recovered from what each ring position holds.

    Args:
        length: tokens of the sequence.
        shares: for every ring position ``p`` (N of them), its non-empty real-token ranges in
            local order: part ``p`` first, then part ``2N-1-p``.

    Returns:
        ``2N`` ranges ``(start, end)`` tiling ``[0, length)`` in order; empty parts are
        ``(x, x)``. A position holding a single piece is read as holding its first part
        whenever that tiles (the other reading differs only by empty parts, so every member
        derives the same layout).

    Raises:
        ValueError: the shares are not a contiguous zigzag split of ``[0, length)``.
    """
    n = len(shares)
    if n < 1:
        raise ValueError("a zigzag split needs at least one ring position")
    if n == 1:
        if [tuple(r) for r in shares[0]] != [(0, length)]:
            raise ValueError(
                f"a ring of size 1 holds the whole sequence [0, {length}), got {list(shares[0])}"
            )
        return ((0, length),)
    pending = [list(share) for share in shares]
    for p, share in enumerate(pending):
        if len(share) > 2:
            raise ValueError(f"ring position {p} holds {len(share)} pieces; at most 2 (parts "
                             f"{p} and {2 * n - 1 - p})")
        for a, b in share:
            if not 0 <= a < b <= length:
                raise ValueError(f"ring position {p}: piece [{a}, {b}) is empty or outside "
                                 f"[0, {length})")
    parts: list[Span] = []
    cursor = 0
    for part in range(2 * n):
        owner = zigzag_part_owner(part, n)
        if pending[owner] and pending[owner][0][0] == cursor:
            a, b = pending[owner].pop(0)
            parts.append((a, b))
            cursor = b
        else:
            parts.append((cursor, cursor))
    left = {p: share for p, share in enumerate(pending) if share}
    if cursor != length or left:
        raise ValueError(
            f"pieces {[list(s) for s in shares]} are not a contiguous zigzag split of "
            f"[0, {length}) over {n} ring positions (position p holds parts p and {2 * n}-1-p, "
            f"in that order, and the {2 * n} parts tile the sequence in order)"
        )
    return tuple(parts)


def padded_part_size(parts: Sequence[Span], align: int = 1) -> int:
    """Rows every part occupies in a member's buffer: the largest part, rounded up to ``align``."""
    if align < 1:
        raise ValueError(f"align ({align}) must be >= 1")
    largest = max(b - a for a, b in parts)
    return max(1, -(-largest // align)) * align


def causal_chunks(length: int, num_chunks: int) -> tuple[Span, ...]:
    """The ``num_chunks`` causal chunks of a sequence split along the pipeline (Seq1F1B-style).

    Chunk ``i`` holds positions ``[floor(i L / k), floor((i + 1) L / k))``: contiguous, in order,
    tiling ``[0, L)``, sizes differing by at most one token (a sequence shorter than ``k`` has
    empty chunks). Each chunk is then zigzagged over the ring on its own, so the ring's members
    stay balanced in every chunk.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks ({num_chunks}) must be >= 1")
    if length < 0:
        raise ValueError(f"length ({length}) must be >= 0")
    bounds = [i * length // num_chunks for i in range(num_chunks + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))
