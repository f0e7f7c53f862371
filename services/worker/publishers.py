"""When may a worker trust "this model is not published" enough to unload it?

Every gateway keeps a publication mark in Redis (keys.MODEL_PUBLISHERS, a
lease it renews every republish check) and, when its mark is gone, writes
back the records of the models it serves before marking again
(services/gateway/republish.py). After Redis lost its data, the model set in
Redis is complete only once *every* live gateway has done so: one gateway
(say one restarting at that moment) marking early says nothing about the
models another one loaded. Redis cannot tell which gateways were live (it
lost that too), so the worker remembers the gateways whose mark it has seen
and unloads nothing while one of them is missing, for at most `grace_s`
from when it first noticed: a live gateway marks again within its check
period (0.25 s), a gateway that is gone for good (killed, stopped; its mark
expired or was withdrawn) is forgotten after the grace.

Pure: no I/O, the caller passes the marks it read and the time.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass
class PublisherWatch:
    grace_s: float
    #: gateway id -> when its mark was first seen missing (None: present)
    missing_since: dict[str, float | None] = field(default_factory=dict)

    def observe(self, present: Collection[str], now: float) -> bool:
        """Record the marks read at `now`; True when the published model set is
        complete, i.e. a model missing from it may be unloaded."""
        seen: dict[str, float | None] = dict.fromkeys(present)
        for gateway, since in self.missing_since.items():
            if gateway in seen:
                continue
            since = now if since is None else since
            if now - since < self.grace_s:
                seen[gateway] = since  # still waiting for it to mark again
        self.missing_since = seen
        # No mark at all: Redis lost the set and no gateway republished yet
        # ("nothing published" means "not known", never "unload everything").
        return bool(present) and all(since is None for since in seen.values())

    def waiting_for(self) -> list[str]:
        return sorted(g for g, since in self.missing_since.items() if since is not None)
