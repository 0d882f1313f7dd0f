"""Exceptions. Every failure of a call that reached libkvrope raises a
KvropeError (or a subclass chosen by its code) carrying:

  .code     the daemon's wire Status number (1..21, docs/protocol.md), or for
            the client's own failures libkvrope's negative code (-1000..)
  .name     the Status name ("E_UNKNOWN_CONTEXT") or the client code's name
            ("KVR_ERR_CLOSED")
  .c_code   libkvrope's return value (-code for daemon statuses)
  .message  the daemon's human-readable message (or the client's)

Arguments that are wrong before anything is sent (dtype, shape, lengths,
types) raise ValueError / TypeError instead, and nothing goes on the wire.
"""

# Status number -> (protocol name, libkvrope name), from docs/protocol.md / kvrope.h.
STATUS = {
    1: ("E_INTERNAL", "KVR_ERR_INTERNAL"),
    2: ("E_BAD_REQUEST", "KVR_ERR_BADREQUEST"),
    3: ("E_BAD_FRAME", "KVR_ERR_BADFRAME"),
    4: ("E_TOO_LARGE", "KVR_ERR_TOOLARGE"),
    5: ("E_UNAUTHENTICATED", "KVR_ERR_UNAUTH"),
    6: ("E_UNKNOWN_MODEL", "KVR_ERR_NOMODEL"),
    7: ("E_UNKNOWN_CONTEXT", "KVR_ERR_NOCTX"),
    8: ("E_EXISTS", "KVR_ERR_EXIST"),
    9: ("E_SHAPE", "KVR_ERR_SHAPE"),
    10: ("E_PAYLOAD_LENGTH", "KVR_ERR_PAYLOAD"),
    11: ("E_RANGE", "KVR_ERR_RANGE"),
    12: ("E_FINGERPRINT", "KVR_ERR_FINGERPRINT"),
    13: ("E_NO_MEMORY", "KVR_ERR_NOMEM"),
    14: ("E_BUSY", "KVR_ERR_BUSY"),
    15: ("E_INVALID", "KVR_ERR_INVAL"),
    16: ("E_UNSUPPORTED", "KVR_ERR_UNSUPPORTED"),
    17: ("E_LIMIT", "KVR_ERR_LIMIT"),
    18: ("E_PROTECTED", "KVR_ERR_PROTECTED"),
    19: ("E_IO", "KVR_ERR_IO"),
    20: ("E_PINNED", "KVR_ERR_PINNED"),
    21: ("E_CONFIG", "KVR_ERR_CONFIG"),
    22: ("E_PENDING", "KVR_ERR_PENDING"),      # proto has it; kvrope.h not yet
    23: ("E_PREFIX", "KVR_ERR_PREFIX"),        # proto has it; kvrope.h not yet
}
CLIENT = {
    -1000: "KVR_ERR_SYS",
    -1001: "KVR_ERR_CLOSED",
    -1002: "KVR_ERR_PROTO",
    -1003: "KVR_ERR_BUFFER",
    -1004: "KVR_ERR_OOM",
}


class KvropeError(Exception):
    """A call failed in the daemon or in libkvrope."""

    def __init__(self, code, message="", name=None, c_code=None):
        self.code = int(code)
        self.c_code = int(c_code) if c_code is not None else (-self.code if self.code > 0 else self.code)
        if name is None:
            name = STATUS[self.code][0] if self.code in STATUS else CLIENT.get(self.code, "E_?")
        self.name = name
        self.message = message
        super().__init__(f"{name} ({self.code}): {message}" if message else f"{name} ({self.code})")


class DaemonError(KvropeError):
    """The daemon answered with a status other than OK."""


class ClientError(KvropeError):
    """libkvrope itself failed (connection, protocol, buffer, memory)."""


class ConnectionFailed(ClientError):
    """KVR_ERR_SYS / KVR_ERR_CLOSED / KVR_ERR_PROTO: the connection is closed."""


class BufferTooSmall(ClientError):
    """KVR_ERR_BUFFER: the caller's `out` array cannot hold the payload."""


class Unsupported(KvropeError, NotImplementedError):
    """The loaded libkvrope lacks the function a method needs (an older
    build); code 16 (E_UNSUPPORTED), nothing was sent."""

    def __init__(self, what):
        super().__init__(16, what)


def _daemon_class(camel):
    return type(camel, (DaemonError,), {"__doc__": f"Daemon status {camel}."})


InternalError = _daemon_class("InternalError")
BadRequest = _daemon_class("BadRequest")
BadFrame = _daemon_class("BadFrame")
TooLarge = _daemon_class("TooLarge")
Unauthenticated = _daemon_class("Unauthenticated")
UnknownModel = _daemon_class("UnknownModel")
UnknownContext = _daemon_class("UnknownContext")
Exists = _daemon_class("Exists")
ShapeMismatch = _daemon_class("ShapeMismatch")
PayloadLength = _daemon_class("PayloadLength")
RangeError = _daemon_class("RangeError")
FingerprintMismatch = _daemon_class("FingerprintMismatch")
NoMemory = _daemon_class("NoMemory")
Busy = _daemon_class("Busy")
InvalidArgument = _daemon_class("InvalidArgument")
UnsupportedByDaemon = _daemon_class("UnsupportedByDaemon")
LimitExceeded = _daemon_class("LimitExceeded")
Protected = _daemon_class("Protected")
IOFailure = _daemon_class("IOFailure")
Pinned = _daemon_class("Pinned")
ConfigRefused = _daemon_class("ConfigRefused")
Pending = _daemon_class("Pending")
PrefixMismatch = _daemon_class("PrefixMismatch")

BY_CODE = {
    1: InternalError, 2: BadRequest, 3: BadFrame, 4: TooLarge, 5: Unauthenticated,
    6: UnknownModel, 7: UnknownContext, 8: Exists, 9: ShapeMismatch, 10: PayloadLength,
    11: RangeError, 12: FingerprintMismatch, 13: NoMemory, 14: Busy, 15: InvalidArgument,
    16: UnsupportedByDaemon, 17: LimitExceeded, 18: Protected, 19: IOFailure, 20: Pinned,
    21: ConfigRefused, 22: Pending, 23: PrefixMismatch,
    -1000: ConnectionFailed, -1001: ConnectionFailed, -1002: ConnectionFailed,
    -1003: BufferTooSmall, -1004: ClientError,
}


def from_c(c_code, message):
    """The exception for a negative libkvrope return value."""
    code = -c_code if -1000 < c_code < 0 else c_code   # daemon statuses: -1..-999
    cls = BY_CODE.get(code, DaemonError if code > 0 else ClientError)
    return cls(code, message)


__all__ = ["KvropeError", "DaemonError", "ClientError", "ConnectionFailed", "BufferTooSmall",
           "Unsupported", "STATUS"] + [c.__name__ for c in set(BY_CODE.values())]
