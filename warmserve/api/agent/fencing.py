"""The fencing token's layout on the wire (``fencing_token``, a uint64 of every mutating call
and ``Describe``).

A token names one operator leadership term: the Lease's ``creationTimestamp`` (unix seconds) in
the high bits, its ``leaseTransitions`` in the low :data:`TERM_BITS`.  The operator encodes its
term with :func:`fencing_token`; the agent decodes a token with :func:`split` to judge it
against its fence.  One definition, so the two ends cannot disagree on the layout.
"""

from __future__ import annotations

MAX_TOKEN = 2**64 - 1  # uint64 on the wire
TERM_BITS = 32  # leaseTransitions in the low bits
TERM_MASK = (1 << TERM_BITS) - 1


def fencing_token(created_s: int, transitions: int) -> int:
    """The fencing token of a term: the Lease's ``creationTimestamp`` (unix seconds) in the high
    bits, its ``leaseTransitions`` in the low 32.  ``leaseTransitions`` orders the terms of one
    Lease; the creation time orders Leases, so a Lease deleted and created again (a reinstall, a
    new ``--peering``, a fresh cluster over the same nodes) starts above every token of the old
    one instead of at 1, which agents that remember the old tokens (their ``--fencing-file``)
    would refuse for good.  A uint64 (the wire type) until the year 2106."""
    if not 0 <= transitions < 2**TERM_BITS or not 0 <= created_s < 2**32:
        raise ValueError(f"no fencing token for created={created_s} transitions={transitions}")
    return (created_s << TERM_BITS) | transitions


def split(token: int) -> tuple[int, int]:
    """(Lease creation time in unix seconds, term) of a token."""
    return token >> TERM_BITS, token & TERM_MASK
