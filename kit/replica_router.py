"""Chapter 18: the prefix-aware router as a Ray Serve RequestRouter (`--router prefix`).

Ray Serve routes each call of a deployment handle in the caller's process: here the ingress,
the one process that runs the OpenAI app, so one router and one tree serve the whole service.
The rule itself is minivllm/routing.py; this class feeds it the request's token ids, its
tenant's salt and its adapter, and the replicas' loads as this router counts them (requests
sent and not yet completed: exact, since every request goes through it). Ray's default,
power of two choices (`--router pow2`), is its PowerOfTwoChoicesRequestRouter; Ray ships a
prefix router of its own too, ray.serve.llm's PrefixCacheAffinityRouter, which keeps a
character tree of the prompts' text.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from minivllm.routing import DEFAULT_BLOCK, DEFAULT_IMBALANCE, PrefixRouter


class PrefixRequestRouter(FIFOMixin, RequestRouter):
    """The replica holding the longest prefix of the prompt, unless its queue is too long."""

    def initialize_state(self, block_size: int = DEFAULT_BLOCK, imbalance: int = DEFAULT_IMBALANCE, **_):
        self.router = PrefixRouter(block_size=block_size, imbalance=imbalance)
        self.in_flight: dict[ReplicaID, int] = {}
        self.requests: dict[str, ReplicaID] = {}   # internal request id -> its replica, until it completes

    def _state(self) -> PrefixRouter:
        if not hasattr(self, "router"):   # Ray calls initialize_state; a router built without it still works
            self.initialize_state()
        return self.router

    # --8<-- [start:router]
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        router = self._state()
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        job = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(job, dict) or "ids" not in job:   # not a generation (e.g. info): any replica
            return [candidate_replicas]
        loads = {rid: self.in_flight.get(rid, 0) for rid in by_id}
        chosen = router.route(job["ids"], loads, job.get("salt"), job.get("adapter"))
        rest = sorted((r for r in candidate_replicas if r.replica_id != chosen), key=lambda r: loads[r.replica_id])
        return [[by_id[chosen]], rest]   # the first rank, then the others should it refuse
    # --8<-- [end:router]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._state()
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.requests[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._state()
        if self.requests.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._state().tree.forget(replica_id)   # its cache died with it
        self.in_flight.pop(replica_id, None)
