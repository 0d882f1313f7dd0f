"""Exceptions. Every failure of a call that reached libkvrope raises a
KvropeError (or a subclass chosen by its code) carrying:

  .code     the daemon's wire Status number (1..999, docs/protocol.md), or for
            the client's own failures libkvrope's negative code (KVR_ESYS, ...)
  .name     the Status name ("E_UNKNOWN_CONTEXT") or the client code's name
            ("KVR_ESYS")
  .c_code   libkvrope's return value (a KVR_E* code, base/error.h)
  .message  the daemon's human-readable message (or the client's)

The codes, names and Status numbers are not repeated here: they are read from
the loaded libkvrope (kvr_error_codes and friends, generated in C from the one
list in base/error.h). `errors.KVR_ENOCTX` etc. are the library's values;
`errors.STATUS` maps Status number -> (protocol name, libkvrope name).
This module only chooses which Python class each code raises.

Arguments that are wrong before anything is sent (dtype, shape, lengths,
types) raise ValueError / TypeError instead, and nothing goes on the wire.
"""

from ctypes import byref, c_size_t


class KvropeError(Exception):
    """A call failed in the daemon or in libkvrope."""

    def __init__(self, code, message="", name=None, c_code=None):
        t = _tables()
        self.code = int(code)
        if c_code is None:
            c_code = t.by_status[self.code][0] if self.code in t.by_status else self.code
        self.c_code = int(c_code)
        if name is None:
            info = t.by_c.get(self.c_code)
            name = (info[2] or info[1]) if info else "E_?"
        self.name = name
        self.message = message
        super().__init__(f"{name} ({self.code}): {message}" if message else f"{name} ({self.code})")


class DaemonError(KvropeError):
    """The daemon answered with a status other than OK."""


class ClientError(KvropeError):
    """libkvrope itself failed (connection, protocol, buffer)."""


class ConnectionFailed(ClientError):
    """KVR_ESYS / KVR_ECLOSED / KVR_EPROTO: the connection is closed."""


class BufferTooSmall(ClientError):
    """KVR_EBUFFER: the caller's `out` array cannot hold the payload."""


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

# libkvrope code name -> Python class. A code the library has and this table
# lacks raises DaemonError / ClientError (tests/python check both directions).
CLASS_OF = {
    "KVR_EINTERNAL": InternalError, "KVR_EBADREQUEST": BadRequest, "KVR_EBADFRAME": BadFrame,
    "KVR_ETOOLARGE": TooLarge, "KVR_EUNAUTH": Unauthenticated, "KVR_ENOMODEL": UnknownModel,
    "KVR_ENOCTX": UnknownContext, "KVR_EEXIST": Exists, "KVR_ESHAPE": ShapeMismatch,
    "KVR_EPAYLOAD": PayloadLength, "KVR_ERANGE": RangeError,
    "KVR_EFINGERPRINT": FingerprintMismatch, "KVR_ENOMEM": NoMemory, "KVR_EBUSY": Busy,
    "KVR_EINVAL": InvalidArgument, "KVR_EUNSUPPORTED": UnsupportedByDaemon,
    "KVR_ELIMIT": LimitExceeded, "KVR_EPROTECTED": Protected, "KVR_EIO": IOFailure,
    "KVR_EPINNED": Pinned, "KVR_ECONFIG": ConfigRefused, "KVR_EPENDING": Pending,
    "KVR_EPREFIX": PrefixMismatch,
    "KVR_ESYS": ConnectionFailed, "KVR_ECLOSED": ConnectionFailed,
    "KVR_EPROTO": ConnectionFailed, "KVR_EBUFFER": BufferTooSmall,
}


class _Tables:
    """The error space as the loaded libkvrope defines it."""

    def __init__(self, lib):
        n = c_size_t()
        arr = lib.kvr_error_codes(byref(n))
        self.by_c = {}        # c_code -> (status or None, c name, status name or None, text)
        self.by_status = {}   # status -> (c_code, status name)
        self.by_name = {}     # c name -> c_code
        for i in range(n.value):
            c = arr[i]
            name = lib.kvr_error_name(c).decode()
            sname = lib.kvr_error_status_name(c)
            sname = sname.decode() if sname else None
            status = lib.kvr_error_status(c) if sname else None
            self.by_c[c] = (status, name, sname, lib.kvr_strerror(c).decode())
            self.by_name[name] = c
            if sname is not None:
                self.by_status[status] = (c, sname)


_TABLES = None


def _tables():
    global _TABLES
    if _TABLES is None:
        from . import _lib
        _TABLES = _Tables(_lib.load())
    return _TABLES


def __getattr__(attr):
    """errors.KVR_ENOCTX, errors.STATUS: read from the library on first use."""
    if attr == "STATUS":
        t = _tables()
        return {s: (sn, t.by_c[c][1]) for s, (c, sn) in t.by_status.items() if s}
    if attr.startswith("KVR_") and attr in _tables().by_name:
        return _tables().by_name[attr]
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def from_c(c_code, message):
    """The exception for a negative libkvrope return value."""
    t = _tables()
    info = t.by_c.get(c_code)
    if info is None:
        return ClientError(c_code, message, name="KVR_EUNKNOWN", c_code=c_code)
    status, name, sname, _ = info
    code = status if sname is not None else c_code
    cls = CLASS_OF.get(name, DaemonError if sname is not None else ClientError)
    return cls(code, message, name=sname or name, c_code=c_code)


__all__ = ["KvropeError", "DaemonError", "ClientError", "ConnectionFailed", "BufferTooSmall",
           "Unsupported"] + sorted({c.__name__ for c in CLASS_OF.values()})
