"""The socket between a worker and one stub process (process_instance.py, stub.py).

Messages are tuples whose first item names them. The three that carry a
batch ("exec", "part", "done": a name, a batch id and protobuf bytes) are
framed by hand: a 13-byte header, then the bytes, written with one
`sendmsg` (no concatenation) and read with `recv_into` a buffer of the right
size. Every other message (init, BLS calls and answers, close) is pickled.

Why not multiprocessing's Connection, which the first version used: it
pickles the bytes (a copy), writes what the socket does not take by slicing
the rest (a copy per partial write) and reads into a BytesIO (more copies).
Measured with the `trivial` model.py of bench.python_backend on the 2-core
dev machine, CPU per batch through a stub, with Connection -> with this
module: a batch of 1 KB 284 -> 239 us, of 128 KB 926 -> 775 us (the same
batches in-process: 20-22 and 215-247 us). What remains is the work
in-process instances do too, plus a thread hand-off at each end and the
kernel's copies (py-spy on both processes).
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
from typing import Any

# kind (1 byte), batch id (8), payload length (4)
_HEADER = struct.Struct("!BQI")
_FRAMED = {"exec": 1, "part": 2, "done": 3}
_NAMES = {v: k for k, v in _FRAMED.items()}
_PICKLED = 0


class StubSocket:
    """One end of the socket; send may be called from several threads."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._header = bytearray(_HEADER.size)
        self.closed = False

    def send(self, message: tuple) -> None:
        kind = _FRAMED.get(message[0])
        if kind is not None:
            _, ident, payload = message
        else:
            kind, ident, payload = _PICKLED, 0, pickle.dumps(message, protocol=5)
        header = _HEADER.pack(kind, ident, len(payload))
        with self._send_lock:
            sent = self._sock.sendmsg([header, payload])
            total = len(header) + len(payload)
            if sent < total:  # the rest, without copying it
                view = memoryview(payload)[max(0, sent - len(header)) :]
                if sent < len(header):
                    self._sock.sendall(header[sent:])
                self._sock.sendall(view)

    def recv(self) -> Any:
        """The next message; EOFError once the other end closed."""
        self._read_into(memoryview(self._header))
        kind, ident, length = _HEADER.unpack(self._header)
        payload = bytearray(length)
        self._read_into(memoryview(payload))
        if kind == _PICKLED:
            return pickle.loads(payload)
        return (_NAMES[kind], ident, payload)  # protobuf parses a bytearray as is

    def _read_into(self, view: memoryview) -> None:
        while view:
            n = self._sock.recv_into(view)
            if n == 0:
                raise EOFError("stub socket closed")
            view = view[n:]

    def poll(self, timeout: float) -> bool:
        """True when a message (or the end of file) can be read."""
        ready, _, _ = select.select([self._sock], [], [], timeout)
        return bool(ready)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self.closed = True
        self._sock.close()
