"""Where an engine's KV blocks lie in its KV range: what the agent maps for a given capacity.

The KV range of a slot starts at the first page after the weights.  An engine keeps its KV cache
there in *blocks*; a capacity of ``t`` blocks lets it touch blocks ``[0, t)`` and nothing else.
Which pages those blocks need depends on the engine's layout:

* the simulated engine allocates page by page from the start: block ``b`` is page ``b``
  (:meth:`KvGeometry.pages`, also the agent's assumption until an engine says otherwise);
* vLLM's CPU layout is layer-major (``LBHNC``): block ``b`` of layer ``l`` is at
  ``l * layer_stride + b * block_stride``, so blocks ``[0, t)`` need a little of *every*
  layer's region — one *segment* per layer.

So the agent maps pages in the order blocks need them (:meth:`KvGeometry.page_order`) and grants
the engine every block whose pages are all mapped; lending gives back exactly the pages no kept
block touches, in every layer's region, not only the tail.  Pure and deterministic; crosses the
worker pipe inside :class:`~warmserve_agent.engines.spec.EngineStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SEGMENTS = 4096  # an engine's report is bounded (layers x cache groups)


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Block ``b`` of segment ``(offset, stride)`` is bytes ``[offset + b * stride,
    offset + (b + 1) * stride)`` of the KV range (per tensor-parallel rank).  ``block_bytes``
    is the capacity one block adds (bytes per rank); ``num_blocks`` how many there are."""

    num_blocks: int
    block_bytes: int
    segments: tuple[tuple[int, int], ...]

    @staticmethod
    def pages(page_bytes: int, num_pages: int) -> KvGeometry:
        """One block per page, from the start of the range."""
        return KvGeometry(max(0, num_pages), page_bytes, ((0, page_bytes),))

    def validate(self, kv_bytes: int) -> None:
        """Refuse a geometry that does not fit the KV range (an engine's report is checked
        before the agent maps by it)."""
        if self.num_blocks < 0 or self.block_bytes < 1:
            raise ValueError(f"KV geometry: {self.num_blocks} blocks of {self.block_bytes} bytes")
        if not 1 <= len(self.segments) <= MAX_SEGMENTS:
            raise ValueError(f"KV geometry: {len(self.segments)} segments (1..{MAX_SEGMENTS})")
        for off, stride in self.segments:
            if off < 0 or stride < 1 or off + self.num_blocks * stride > kv_bytes:
                raise ValueError(
                    f"KV geometry: segment ({off}, {stride}) x {self.num_blocks} blocks leaves "
                    f"the {kv_bytes}-byte KV range"
                )

    def first_blocks(self, page_bytes: int, num_pages: int) -> list[int]:
        """For every page of the range, the first block that touches it (``num_blocks`` for
        pages no block touches)."""
        nb = self.num_blocks
        first = [nb] * num_pages
        for off, stride in self.segments:
            lo = off // page_bytes
            hi = min(num_pages, -(-(off + nb * stride) // page_bytes))
            for p in range(lo, hi):
                b = max(0, (p * page_bytes - off) // stride)
                if b < first[p]:
                    first[p] = b
        return first

    def page_order(self, page_bytes: int, num_pages: int) -> tuple[list[int], list[int]]:
        """``(order, need)``: the range's pages sorted by the first block that touches them
        (ties by page), and that block for each.  Blocks ``[0, t)`` need exactly the first
        ``bisect_left(need, t)`` pages of ``order``."""
        if self.segments == ((0, page_bytes),) and self.num_blocks >= num_pages:
            return list(range(num_pages)), list(range(num_pages))  # one block per page
        first = self.first_blocks(page_bytes, num_pages)
        order = sorted(range(num_pages), key=lambda p: (first[p], p))
        return order, [first[p] for p in order]

    def blocks(self, nbytes: int, tp: int = 1) -> int:
        """Whole blocks in a capacity of ``nbytes`` summed over ``tp`` ranks."""
        return max(0, nbytes) // (self.block_bytes * max(1, tp))

    def capacity(self, blocks: int, tp: int = 1) -> int:
        """Bytes summed over ``tp`` ranks of ``blocks`` blocks (the engine's capacity unit)."""
        return max(0, blocks) * self.block_bytes * max(1, tp)
