"""Fetcher values as ``warmserve.agent.v1`` messages (one place for the conversion)."""

from __future__ import annotations

from warmserve.api.agent.v1 import agent_pb2 as pb
from warmserve_agent.sources.fetch_records import FetchState, FetchStatus, StoreUsage

FETCH_STATE = {
    FetchState.LISTING: pb.FETCH_STATE_LISTING,
    FetchState.DOWNLOADING: pb.FETCH_STATE_DOWNLOADING,
    FetchState.VERIFYING: pb.FETCH_STATE_VERIFYING,
    FetchState.DONE: pb.FETCH_STATE_DONE,
    FetchState.FAILED: pb.FETCH_STATE_FAILED,
}


def fetch_pb(st: FetchStatus) -> pb.FetchInfo:
    return pb.FetchInfo(
        model=st.model,
        source=st.source,
        state=FETCH_STATE[st.state],
        bytes_done=st.bytes_done,
        bytes_total=st.bytes_total,
        bytes_per_second=st.bytes_per_s,
        eta_seconds=st.eta_s,
        attempt=st.attempt,
        message=st.message,
        started_unix=st.started_unix,
        finished_unix=st.finished_unix,
    )


def store_pb(u: StoreUsage) -> pb.StoreInfo:
    return pb.StoreInfo(used_bytes=u.used_bytes, budget_bytes=u.budget_bytes, evictions=u.evictions)
