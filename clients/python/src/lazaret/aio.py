"""asyncio style: `AsyncClient` has the producer and worker calls of
`Client` as coroutines (each runs the standard-library client in a thread
with `asyncio.to_thread`, so an event loop is never blocked). Handlers of a
`Worker` may be `async def` too."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .client import Client, Enqueued, Heartbeat, LeasedJob, LeaseRequest, NewJob, Outcome
from .errors import ApiError
from .failure import Failure


class AsyncClient:
    """`Client`'s calls as coroutines; `AsyncClient(client)` or the same arguments as `Client`."""

    def __init__(self, server: Union[str, Client] = "http://127.0.0.1:7433", **kwargs: Any) -> None:
        self.sync = server if isinstance(server, Client) else Client(server, **kwargs)

    async def enqueue(self, type: str, tenant: str, payload: Any, **fields: Any) -> Enqueued:
        return await asyncio.to_thread(self.sync.enqueue, type, tenant, payload, **fields)

    async def enqueue_batch(self, jobs: Sequence[NewJob]) -> List[Union[Enqueued, ApiError]]:
        return await asyncio.to_thread(self.sync.enqueue_batch, jobs)

    async def job(self, id: str) -> Dict[str, Any]:
        return await asyncio.to_thread(self.sync.job, id)

    async def cancel(self, id: str) -> Dict[str, Any]:
        return await asyncio.to_thread(self.sync.cancel, id)

    async def lease(self, request: Optional[LeaseRequest] = None, **fields: Any) -> List[LeasedJob]:
        return await asyncio.to_thread(self.sync.lease, request, **fields)

    async def ack(self, id: str, lease_token: str, *, next: Optional[LeaseRequest] = None) -> Outcome:
        return await asyncio.to_thread(self.sync.ack, id, lease_token, next=next)

    async def fail(self, id: str, lease_token: str, failure: Failure, *, next: Optional[LeaseRequest] = None) -> Outcome:
        return await asyncio.to_thread(self.sync.fail, id, lease_token, failure, next=next)

    async def heartbeat(self, id: str, lease_token: str, extend_ms: Optional[int] = None) -> Heartbeat:
        return await asyncio.to_thread(self.sync.heartbeat, id, lease_token, extend_ms)

    async def acks(self, items: Sequence[Tuple[str, str]]) -> List[Union[Outcome, ApiError]]:
        return await asyncio.to_thread(self.sync.acks, items)

    async def fails(self, items: Sequence[Tuple[str, str, Failure]]) -> List[Union[Outcome, ApiError]]:
        return await asyncio.to_thread(self.sync.fails, items)
