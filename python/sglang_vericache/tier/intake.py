"""Reading one request off the KV server's ROUTER socket under the message limits.

libzmq hands a multipart message to the application only once all of it has arrived, and
ZMQ_MAXMSGSIZE (set on the socket) already disconnects a peer whose single frame is too big.
What is left to the server is not to keep, hash or parse more than the limits allow: frames
are taken one at a time, counted and summed as they come, and past a limit the rest of the
message is read and dropped at once (its memory goes back to libzmq, nothing is hashed).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq


@dataclass(frozen=True, slots=True)
class MessageLimits:
    """max_frames: frames after the peer identity; max_frame_bytes / max_message_bytes: the
    largest frame and the largest sum over the message's frames."""

    max_frames: int
    max_frame_bytes: int
    max_message_bytes: int


def receive_message(sock: zmq.Socket, limits: MessageLimits
                    ) -> tuple[list[zmq.Frame], str | None]:
    """One message from a ROUTER socket: (identity + the frames kept, why refused or None).

    On refusal only the identity and the first (header) frame are kept, for the error reply.
    Raises zmq.Again when no message is waiting.
    """
    kept = [sock.recv(zmq.NOBLOCK, copy=False)]  # the ROUTER's peer identity
    total, count, refusal = 0, 0, None
    more = kept[0].more
    while more:
        frame = sock.recv(copy=False)  # the rest of the message is already here
        more = frame.more
        count += 1
        total += len(frame)
        if refusal is not None:
            continue
        if count > limits.max_frames:
            refusal = f"message has more than {limits.max_frames} frames"
        elif len(frame) > limits.max_frame_bytes or total > limits.max_message_bytes:
            refusal = f"message exceeds {limits.max_message_bytes} bytes"
        else:
            kept.append(frame)
    if refusal is not None:
        del kept[2:]  # identity + header only: the payload is dropped unread
    return kept, refusal
