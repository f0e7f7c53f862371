"""A StreamLink of the scheduler's Schedule stream over any channel, for the
transport tests (grpc.aio's channel) and the own HTTP/2 client's (H2Channel)."""

from __future__ import annotations

from typing import Any

import grpc

from stageserve.generated import stageserve_pb2 as pb
from stageserve.generated import stageserve_pb2_grpc as pb_grpc
from stageserve.transport import StreamLink
from stageserve.write_hold import WriteHold


class Broken(Exception):
    """The link's error when its stream breaks (its on_break)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


def scheduler_link(
    channel: Any, ready=None, hold: WriteHold | None = None
) -> StreamLink[pb.ScheduleRequest, pb.ScheduleResponse]:
    """`channel`: grpc.aio's or an H2Channel (both build the generated stub)."""
    return StreamLink(
        name="test",
        open_call=pb_grpc.SchedulerStub(channel).Schedule,
        pack=lambda requests: pb.ScheduleBatch(requests=requests),
        unpack=lambda message: message.responses,
        on_break=Broken,
        ready=ready,
        hold=hold,
    )
