"""One HTTP/2 connection carrying gRPC, as a pure state machine: bytes in,
events and bytes out, no I/O. `ServerConnection` is the server's side,
`ClientConnection` the client's; they share everything but who opens
streams and when a stream is over.

`receive(data)` parses frames and returns the calls' events (a stream's
first header block, each whole gRPC message, the peer's end of stream, a
reset, a later header block: a response's trailers); the frames the protocol
answers itself (SETTINGS and PING acknowledgements, WINDOW_UPDATEs) are
queued for `data_to_send()`. `send_headers` and `send_message` queue a
stream's frames within the peer's flow-control windows: what does not fit
waits, in order with the stream's later frames, until a WINDOW_UPDATE or
SETTINGS opens the window.

It implements what gRPC over HTTP/2 uses (RFC 9113; gRPC's PROTOCOL-HTTP2):
no server push, no priorities (read and ignored), header blocks through
CONTINUATION, padding, and flow control both ways. The inbound windows are
large (16 MiB a stream, 64 MiB the connection) and are refilled as data
arrives, so a peer is never held back by this side's reading.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, TypeVar, cast

import hpack

from stageserve.h2grpc import wire

REQUEST, MESSAGE, END, RESET, GOAWAY, TRAILERS = range(6)
#: An event: (kind, stream id, value): REQUEST -> a stream's first header
#: list (a request's, or on the client a response's) as (name, value) bytes
#: pairs; MESSAGE -> (compressed flag, message bytes); END -> None; RESET ->
#: the peer's error code; GOAWAY -> (last stream id, error code) (stream 0);
#: TRAILERS -> a later header list of the stream (a response's trailers).
Event = tuple[int, int, Any]

STREAM_WINDOW = 16 * 1024 * 1024
CONNECTION_WINDOW = 64 * 1024 * 1024
#: The largest frame this side accepts: a 49 KB tensor arrives in one DATA
#: frame instead of four, and each frame is a turn of Python here.
MAX_FRAME_IN = 1024 * 1024
MAX_REMEMBERED_BLOCKS = 64
#: A header block larger than this ends the connection (COMPRESSION_ERROR, as
#: a client that sends it is not one to keep). Smaller ones are decoded
#: whole, so HPACK's table stays in step, and a header list over grpc's
#: hard limit (server.py, METADATA_HARD_LIMIT) fails only its own call.
MAX_HEADER_LIST = 1024 * 1024
#: A message this large goes out as its pieces (write_to), not joined.
LARGE_MESSAGE = 16 * 1024


class ProtocolError(Exception):
    """A connection error: the caller sends `goaway(code)` and closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Stream:
    __slots__ = (
        "sid",
        "send_window",
        "pending",
        "buf",
        "unacked",
        "remote_open",
        "local_open",
        "started",
    )

    def __init__(self, sid: int, send_window: int) -> None:
        self.sid = sid
        self.send_window = send_window
        # Frames waiting for window: (payload, is_data, end_stream).
        self.pending: deque[tuple[bytes | memoryview, bool, bool]] = deque()
        self.buf = bytearray()  # a gRPC message split across DATA frames
        self.unacked = 0  # bytes received since the last stream WINDOW_UPDATE
        self.remote_open = True
        self.local_open = True
        self.started = False  # its first header block (request or response) was seen


class _Connection:
    """What both sides of a connection do alike."""

    def __init__(self, preface_in: bool) -> None:
        """`preface_in`: the peer starts with the client preface (this is the server)."""
        self._in = bytearray()
        self._out: list[bytes | memoryview] = []
        self._out_large = False  # a message of LARGE_MESSAGE bytes or more is queued
        self._preface_seen = not preface_in
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        self._blocks: dict[bytes, list[tuple[bytes, bytes]]] = {}  # see _decode
        self._streams: dict[int, _Stream] = {}
        self._blocked: dict[int, _Stream] = {}  # streams with pending frames, in order
        self._peer_window = wire.DEFAULT_WINDOW  # the peer's initial stream window
        self._peer_max_frame = wire.DEFAULT_MAX_FRAME
        self._send_window = wire.DEFAULT_WINDOW  # connection-level, toward the peer
        self._recv_unacked = 0
        self._headers_of: _Stream | None = None  # a block continuing in CONTINUATION
        self._header_block = bytearray()
        self._header_end_stream = False
        self.last_stream_id = 0
        settings = b"".join(
            (
                _setting(wire.SETTINGS_ENABLE_PUSH, 0),
                _setting(wire.SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                _setting(wire.SETTINGS_MAX_FRAME_SIZE, MAX_FRAME_IN),
            )
        )
        self._out.append(wire.frame(wire.SETTINGS, 0, 0, settings))
        self._out.append(
            wire.frame(
                wire.WINDOW_UPDATE,
                0,
                0,
                (CONNECTION_WINDOW - wire.DEFAULT_WINDOW).to_bytes(4, "big"),
            )
        )

    # ------------------------------------------------------------------ output

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        out = b"".join(self._out)
        self._out.clear()
        self._out_large = False
        return out

    def write_to(self, transport: asyncio.WriteTransport) -> None:
        """What is queued, to `transport`: joined into one write, or, when it
        carries a large message, as its pieces (writelines): uvloop sends
        those with one writev, without the copy a join makes. Many small
        pieces cost more that way than joined (a 90-piece flush: 5.3 against
        2.9 us), so only a large message takes it."""
        if not self._out:
            return
        if self._out_large:
            transport.writelines(self._out)
            self._out = []
            self._out_large = False
        else:
            transport.write(self.data_to_send())

    def has_output(self) -> bool:
        return bool(self._out)

    def is_open(self, sid: int) -> bool:
        """Whether the stream can still carry this side's frames."""
        stream = self._streams.get(sid)
        return stream is not None and stream.local_open

    def waiting_for_window(self) -> bool:
        """Whether frames are queued until the peer opens its flow-control window."""
        return bool(self._blocked)

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        stream = self._streams.get(sid)
        if stream is None or not stream.local_open:
            return
        if end_stream:
            stream.local_open = False
        if stream.pending:
            stream.pending.append((block, False, end_stream))
        else:
            self._write_headers(sid, block, end_stream)
        if end_stream:
            self._maybe_close(stream)

    def send_message(
        self, sid: int, message: bytes | wire.MessageParts, compressed: bool = False
    ) -> None:
        """One gRPC message as DATA, within the flow-control windows
        (`compressed`: its bytes are, with the stream's grpc-encoding)."""
        stream = self._streams.get(sid)
        if stream is None or not stream.local_open:
            return
        if isinstance(message, wire.MessageParts):
            parts: wire.MessageParts | None = message
            whole = b""
            size = message.byte_size()
        else:
            parts, whole, size = None, message, len(message)
        prefix = (b"\x01" if compressed else b"\x00") + size.to_bytes(4, "big")
        total = size + 5
        if size >= LARGE_MESSAGE:
            self._out_large = True
        if not stream.pending and total <= self._send_window and total <= stream.send_window:
            # within the windows: frames of the message's own bytes, not copied here
            limit = self._peer_max_frame
            out = self._out
            if parts is not None:
                out += _frames_of(prefix, parts, total, limit, sid)
            elif total <= limit:
                out += (wire.frame_header(total, wire.DATA, 0, sid), prefix, whole)
            else:  # gRPC clients take frames of 16 KiB: a 49 KB answer is four
                out += _lead_then(prefix, whole, total, limit, sid)
            self._send_window -= total
            stream.send_window -= total
            return
        # sliced into frames without copies
        payload = memoryview(prefix + (whole if parts is None else b"".join(parts)))
        if stream.pending:
            stream.pending.append((payload, True, False))
        else:
            self._write_data(stream, payload, False)

    def reset(self, sid: int, code: int = wire.CANCEL) -> None:
        stream = self._streams.pop(sid, None)
        if stream is not None:
            self._blocked.pop(sid, None)
            self._out.append(wire.frame(wire.RST_STREAM, 0, sid, code.to_bytes(4, "big")))

    def goaway(
        self, code: int = wire.NO_ERROR, debug: bytes = b"", last_stream_id: int | None = None
    ) -> None:
        """`last_stream_id` None: the last stream taken (2**31 - 1 announces a
        shutdown without naming it yet, as grpc's first GOAWAY does)."""
        last = self.last_stream_id if last_stream_id is None else last_stream_id
        payload = last.to_bytes(4, "big") + code.to_bytes(4, "big") + debug
        self._out.append(wire.frame(wire.GOAWAY, 0, 0, payload))

    def ping(self, payload: bytes = bytes(8)) -> None:
        self._out.append(wire.frame(wire.PING, 0, 0, payload))

    def _write_headers(self, sid: int, block: bytes, end_stream: bool) -> None:
        flags = wire.END_STREAM if end_stream else 0
        limit = self._peer_max_frame
        if len(block) <= limit:
            self._out.append(wire.frame(wire.HEADERS, flags | wire.END_HEADERS, sid, block))
            return
        self._out.append(wire.frame(wire.HEADERS, flags, sid, block[:limit]))
        for at in range(limit, len(block), limit):
            last = at + limit >= len(block)
            chunk = block[at : at + limit]
            self._out.append(
                wire.frame(wire.CONTINUATION, wire.END_HEADERS if last else 0, sid, chunk)
            )

    def _write_data(self, stream: _Stream, payload: bytes | memoryview, end_stream: bool) -> bool:
        """Write what the windows allow; queue the rest. True when all went out."""
        sent = 0
        total = len(payload)
        limit = self._peer_max_frame
        while sent < total:
            room = min(self._send_window, stream.send_window, limit, total - sent)
            if room <= 0:
                stream.pending.appendleft((payload[sent:], True, end_stream))
                self._blocked[stream.sid] = stream
                return False
            last = sent + room == total
            flags = wire.END_STREAM if (last and end_stream) else 0
            self._out.append(wire.frame_header(room, wire.DATA, flags, stream.sid))
            self._out.append(payload[sent : sent + room] if (sent or not last) else payload)
            sent += room
            self._send_window -= room
            stream.send_window -= room
        if total == 0 and end_stream:
            self._out.append(wire.frame(wire.DATA, wire.END_STREAM, stream.sid))
        return True

    def _flush_blocked(self) -> None:
        for sid, stream in list(self._blocked.items()):
            if self._send_window <= 0:
                return
            del self._blocked[sid]
            while stream.pending:
                payload, is_data, end_stream = stream.pending.popleft()
                if is_data:
                    if not self._write_data(stream, payload, end_stream):
                        break
                else:
                    self._write_headers(sid, bytes(payload), end_stream)
            self._maybe_close(stream)

    def _maybe_close(self, stream: _Stream) -> None:
        """Forget a stream once its call is over (each side says when)."""
        raise NotImplementedError

    # ------------------------------------------------------------------- input

    def receive(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        buf = self._in
        if not self._preface_seen:
            buf += data
            if len(buf) < len(wire.PREFACE):
                if not wire.PREFACE.startswith(bytes(buf)):
                    raise ProtocolError(wire.PROTOCOL_ERROR, "not an HTTP/2 client preface")
                return events
            if buf[: len(wire.PREFACE)] != wire.PREFACE:
                raise ProtocolError(wire.PROTOCOL_ERROR, "not an HTTP/2 client preface")
            self._preface_seen = True
            del buf[: len(wire.PREFACE)]
            data = b""
        # Frames are read from the socket's bytes themselves; only a frame
        # cut short by the read waits in `buf` for the rest. A message's bytes
        # are copied once, out of its DATA frame, where they were copied into
        # `buf`, out of it twice and out of the frame: a 49 KB request's
        # frames 12.1-12.8 -> 9.3-9.8 us (`python -m bench.gateway_work`,
        # docs/benchmarks.md).
        if buf:
            buf += data
            at = self._frames(buf, events)
            del buf[:at]
        else:
            at = self._frames(data, events)
            if at < len(data):
                buf += memoryview(data)[at:]
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self._out.append(
                wire.frame(wire.WINDOW_UPDATE, 0, 0, self._recv_unacked.to_bytes(4, "big"))
            )
            self._recv_unacked = 0
        return events

    def _frames(self, source: bytes | bytearray, events: list[Event]) -> int:
        """Handle the whole frames at the start of `source`; how many bytes
        they took. No view of `source` outlives the call (a bytearray with
        one cannot be resized)."""
        at, end = 0, len(source)
        with memoryview(source) as view:
            while end - at >= 9:
                length = source[at] << 16 | source[at + 1] << 8 | source[at + 2]
                if length > MAX_FRAME_IN:
                    raise ProtocolError(wire.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - at - 9 < length:
                    break
                kind = source[at + 3]
                flags = source[at + 4]
                sid = (
                    source[at + 5] << 24
                    | source[at + 6] << 16
                    | source[at + 7] << 8
                    | source[at + 8]
                ) & 0x7FFFFFFF
                frame = view[at + 9 : at + 9 + length]
                at += 9 + length
                if self._headers_of is not None and kind != wire.CONTINUATION:
                    raise ProtocolError(wire.PROTOCOL_ERROR, "header block interrupted")
                if kind == wire.DATA:
                    self._on_data(sid, flags, frame, events)
                else:
                    self._on_control(kind, flags, sid, bytes(frame), events)
                frame.release()
        return at

    def _on_control(
        self, kind: int, flags: int, sid: int, payload: bytes, events: list[Event]
    ) -> None:
        """A frame other than DATA."""
        if kind == wire.HEADERS:
            self._on_headers(sid, flags, payload, events)
        elif kind == wire.CONTINUATION:
            self._on_continuation(sid, flags, payload, events)
        elif kind == wire.SETTINGS:
            self._on_settings(flags, payload)
        elif kind == wire.WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif kind == wire.PING:
            if len(payload) != 8:
                raise ProtocolError(wire.FRAME_SIZE_ERROR, "PING of the wrong size")
            if not flags & wire.ACK:
                self._out.append(wire.frame(wire.PING, wire.ACK, 0, payload))
        elif kind == wire.RST_STREAM:
            stream = self._streams.pop(sid, None)
            self._blocked.pop(sid, None)
            if stream is not None:
                events.append((RESET, sid, int.from_bytes(payload[:4], "big")))
        elif kind == wire.GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            events.append((GOAWAY, 0, (last, int.from_bytes(payload[4:8], "big"))))
        elif kind == wire.PUSH_PROMISE:  # both sides announce SETTINGS_ENABLE_PUSH 0
            raise ProtocolError(wire.PROTOCOL_ERROR, "PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored (RFC 9113 4.1, 5.3.2).

    def _on_data(self, sid: int, flags: int, payload: memoryview, events: list[Event]) -> None:
        """A DATA frame; `payload` is a view of the received bytes, valid
        only during this call: what outlives it is copied."""
        self._recv_unacked += len(payload)  # padding included: it counts against the window
        if flags & wire.PADDED:
            payload = _unpad(payload)
        stream = self._streams.get(sid)
        if stream is None or not stream.remote_open:
            return  # reset or finished here; the connection window is still refilled above
        stream.unacked += len(payload)
        if stream.unacked >= STREAM_WINDOW // 2 and not flags & wire.END_STREAM:
            self._out.append(
                wire.frame(wire.WINDOW_UPDATE, 0, sid, stream.unacked.to_bytes(4, "big"))
            )
            stream.unacked = 0
        buf = stream.buf
        whole = False
        if not buf and len(payload) >= 5:
            size = int.from_bytes(payload[1:5], "big")
            if size + 5 == len(payload):  # the common case: one whole message in one frame
                events.append((MESSAGE, sid, (payload[0] == 1, bytes(payload[5:]))))
                whole = True
        if payload and not whole:
            buf += payload
            while len(buf) >= 5:
                size = int.from_bytes(buf[1:5], "big")
                if len(buf) < size + 5:
                    break
                events.append((MESSAGE, sid, (buf[0] == 1, bytes(buf[5 : 5 + size]))))
                del buf[: 5 + size]
        if flags & wire.END_STREAM:
            self._remote_end(stream, events)

    def _remote_end(self, stream: _Stream, events: list[Event]) -> None:
        stream.remote_open = False
        if stream.buf:  # a message cut short: the call sees its end without it
            stream.buf.clear()
        events.append((END, stream.sid, None))

    def _on_headers(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if sid == 0:
            raise ProtocolError(wire.PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & wire.PADDED:
            payload = _unpad(payload)
        if flags & wire.PRIORITY_FLAG:
            payload = payload[5:]
        stream = self._streams.get(sid)
        if stream is None:
            # None: a stream this side already closed; its block is decoded
            # to keep HPACK in step, and dropped.
            stream = self._peer_stream(sid)
        self._collect(stream, flags, payload, events)

    def _peer_stream(self, sid: int) -> _Stream | None:
        """HEADERS on a stream this side does not know: the stream it opens, or None."""
        raise NotImplementedError

    def _collect(
        self, stream: _Stream | None, flags: int, block: bytes, events: list[Event]
    ) -> None:
        if flags & wire.END_HEADERS:
            self._headers_done(stream, block, bool(flags & wire.END_STREAM), events)
        else:
            self._headers_of = stream if stream is not None else _Stream(0, 0)
            self._header_block = bytearray(block)
            self._header_end_stream = bool(flags & wire.END_STREAM)

    def _on_continuation(self, sid: int, flags: int, payload: bytes, events: list[Event]) -> None:
        stream = self._headers_of
        if stream is None or (stream.sid and stream.sid != sid):
            raise ProtocolError(wire.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        self._header_block += payload
        if len(self._header_block) > MAX_HEADER_LIST:
            raise ProtocolError(wire.COMPRESSION_ERROR, "header block too large")
        if flags & wire.END_HEADERS:
            self._headers_of = None
            block = bytes(self._header_block)
            self._header_block = bytearray()
            self._headers_done(
                stream if stream.sid else None, block, self._header_end_stream, events
            )

    def _headers_done(
        self, stream: _Stream | None, block: bytes, end_stream: bool, events: list[Event]
    ) -> None:
        headers = self._blocks.get(block)
        if headers is None:
            headers = self._decode(block)
        if stream is None:
            return
        if not stream.started:  # a request's or a response's headers
            stream.started = True
            events.append((REQUEST, stream.sid, headers))
        else:  # trailers
            events.append((TRAILERS, stream.sid, headers))
        if end_stream and stream.remote_open:
            self._remote_end(stream, events)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """Decode a header block, and remember it when it is made of indexed
        fields only: such a block leaves HPACK's table as it was, so the same
        bytes mean the same headers until a block that changes the table
        (then every remembered block is forgotten). A gRPC client's requests
        to one method are such blocks after its first: decoding one in Python
        was 28% of a do-nothing server's CPU (py-spy, bench.ceiling h2-direct)."""
        try:
            headers = cast(list[tuple[bytes, bytes]], self._decoder.decode(block, raw=True))
        except Exception as exc:  # hpack's errors: the shared table is now out of step
            raise ProtocolError(wire.COMPRESSION_ERROR, f"header block: {exc}") from None
        if _all_indexed(block):
            if len(self._blocks) >= MAX_REMEMBERED_BLOCKS:
                self._blocks.clear()
            self._blocks[block] = headers
        else:
            self._blocks.clear()
        return headers

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & wire.ACK:
            return
        if len(payload) % 6:
            raise ProtocolError(wire.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for at in range(0, len(payload), 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == wire.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > wire.MAX_WINDOW:
                    raise ProtocolError(wire.FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._peer_window
                self._peer_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == wire.SETTINGS_MAX_FRAME_SIZE:
                if not wire.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError(wire.PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_max_frame = value
        self._out.append(wire.frame(wire.SETTINGS, wire.ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(wire.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            self._send_window += increment
        else:
            stream = self._streams.get(sid)
            if stream is None:
                return
            stream.send_window += increment
        if self._blocked:
            self._flush_blocked()


class ServerConnection(_Connection):
    def __init__(self) -> None:
        super().__init__(preface_in=True)

    def _maybe_close(self, stream: _Stream) -> None:
        """Forget a stream once this side has ended it and sent everything: the
        call is over, and what the client still sends on it is dropped."""
        if not stream.local_open and not stream.pending:
            self._streams.pop(stream.sid, None)

    def _peer_stream(self, sid: int) -> _Stream | None:
        if sid % 2 == 0:
            raise ProtocolError(wire.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        if sid <= self.last_stream_id:
            return None
        self.last_stream_id = sid
        stream = self._streams[sid] = _Stream(sid, self._peer_window)
        return stream


class ClientConnection(_Connection):
    """The client's side: it opens streams (`open_stream`) and ends its half
    of one (`end_stream`); a stream is over once the server ended its half
    (its trailers, or a reset)."""

    def __init__(self) -> None:
        super().__init__(preface_in=False)
        self._out.insert(0, wire.PREFACE)
        self._next_sid = 1

    def open_stream(self, block: bytes) -> int:
        """A new stream whose request headers are `block` (an HPACK block); its id."""
        sid = self._next_sid
        self._next_sid += 2
        self._streams[sid] = _Stream(sid, self._peer_window)
        self._write_headers(sid, block, False)
        return sid

    def end_stream(self, sid: int) -> None:
        """This side's end of the stream (after its queued messages)."""
        stream = self._streams.get(sid)
        if stream is None or not stream.local_open:
            return
        stream.local_open = False
        if stream.pending:
            stream.pending.append((b"", True, True))
        else:
            self._out.append(wire.frame(wire.DATA, wire.END_STREAM, sid))
        self._maybe_close(stream)

    def unfinished(self, sid: int) -> bool:
        """Whether the server has not ended the stream (its trailers, a reset)."""
        stream = self._streams.get(sid)
        return stream is not None and stream.remote_open

    def forget(self, sid: int) -> None:
        """The call is over here: what still arrives on the stream is dropped."""
        self._streams.pop(sid, None)
        self._blocked.pop(sid, None)

    def _maybe_close(self, stream: _Stream) -> None:
        if not stream.local_open and not stream.pending and not stream.remote_open:
            self._streams.pop(stream.sid, None)

    def _peer_stream(self, sid: int) -> _Stream | None:
        return None


def _all_indexed(block: bytes) -> bool:
    """Whether every field of the block is an indexed header field (RFC 7541 6.1)."""
    at, end = 0, len(block)
    while at < end:
        first = block[at]
        if first < 0x80:  # a literal or a table size update
            return False
        at += 1
        if first & 0x7F == 0x7F:  # the index continues in the next bytes
            while at < end and block[at] & 0x80:
                at += 1
            at += 1
    return True


def _frames_of(
    prefix: bytes, parts: wire.MessageParts, total: int, limit: int, sid: int
) -> list[bytes | memoryview]:
    """DATA frames of at most `limit` bytes over the gRPC prefix and the
    message's parts in order: each a frame header, then slices of the parts.
    The common shape, small pieces then one large one (an answer with one
    large output), is cut as one message is: its small head joined."""
    *head, last = parts
    lead = prefix + b"".join(head) if head else prefix
    if len(lead) < limit:
        return _lead_then(lead, last, total, limit, sid)
    out: list[bytes | memoryview] = [wire.frame_header(min(total, limit), wire.DATA, 0, sid)]
    room, left = limit, total
    for part in (prefix, *parts):
        view = part if len(part) <= room else memoryview(part)
        at = 0
        while at < len(view):
            if not room:
                left -= limit
                out.append(wire.frame_header(min(left, limit), wire.DATA, 0, sid))
                room = limit
            piece = view[at : at + room] if at or len(view) > room else view
            out.append(piece)
            at += len(piece)
            room -= len(piece)
    return out


def _lead_then(
    lead: bytes, last: bytes, total: int, limit: int, sid: int
) -> list[bytes | memoryview]:
    """DATA frames of at most `limit` bytes over `lead` (shorter than a
    frame) then `last`, sliced without copies."""
    view = memoryview(last)
    room = limit - len(lead)
    out: list[bytes | memoryview] = [
        wire.frame_header(min(total, limit), wire.DATA, 0, sid),
        lead,
        view[:room] if len(view) > room else view,
    ]
    for at in range(room, len(view), limit):
        piece = view[at : at + limit]
        out += (wire.frame_header(len(piece), wire.DATA, 0, sid), piece)
    return out


def _setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + value.to_bytes(4, "big")


_Frame = TypeVar("_Frame", bytes, memoryview)


def _unpad(payload: _Frame) -> _Frame:
    if not payload:
        raise ProtocolError(wire.PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError(wire.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - pad]
