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
"""

from __future__ import annotations


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
