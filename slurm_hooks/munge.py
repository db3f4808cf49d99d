"""MUNGE credentials through libmunge, with ctypes (standard library only).

Hooks sign each report with a credential whose payload is the SHA-256 of the
request body; the agent decodes it, and so learns that the body came unchanged
from a host holding the cluster's munge key, and from which uid. Expiry and
replay are munge's own checks.
"""
from __future__ import annotations

import ctypes
import hashlib
import threading

_OPT_TTL = 4
_OPT_SOCKET = 8
EMUNGE_CRED_EXPIRED = 15
EMUNGE_CRED_REWOUND = 16
EMUNGE_CRED_REPLAYED = 17
_lib = None
_lib_lock = threading.Lock()


class MungeError(Exception):
    """munge refused to encode or decode; ``code`` is munge's error number."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


def _load() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libmunge.so.2")
            except OSError:
                # find_library runs ldconfig: only worth it when the usual name fails
                from ctypes.util import find_library
                name = find_library("munge")
                try:
                    lib = ctypes.CDLL(name or "libmunge.so")
                except OSError as exc:
                    raise MungeError(-1, f"libmunge not found ({exc}); install munge") \
                        from None
            lib.munge_ctx_create.restype = ctypes.c_void_p
            lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
            lib.munge_ctx_strerror.restype = ctypes.c_char_p
            lib.munge_ctx_strerror.argtypes = [ctypes.c_void_p]
            lib.munge_strerror.restype = ctypes.c_char_p
            lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int]
            lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(ctypes.c_int),
                                         ctypes.POINTER(ctypes.c_uint),
                                         ctypes.POINTER(ctypes.c_uint)]
            _lib = lib
        return _lib


_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]


class _Context:
    def __init__(self, socket: str = "", ttl: int = 0) -> None:
        self.lib = _load()
        self.ctx = self.lib.munge_ctx_create()
        if not self.ctx:
            raise MungeError(5, "munge_ctx_create failed")
        if socket:
            self._set(_OPT_SOCKET, ctypes.c_char_p(socket.encode()))
        if ttl:
            self._set(_OPT_TTL, ctypes.c_int(ttl))

    def _set(self, opt: int, value) -> None:
        self.lib.munge_ctx_set.argtypes = [ctypes.c_void_p, ctypes.c_int, type(value)]
        rc = self.lib.munge_ctx_set(self.ctx, opt, value)
        if rc:
            raise MungeError(rc, self.error(rc))

    def error(self, code: int) -> str:
        text = self.lib.munge_ctx_strerror(self.ctx) or self.lib.munge_strerror(code)
        return text.decode(errors="replace") if text else f"munge error {code}"

    def __enter__(self) -> "_Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.lib.munge_ctx_destroy(self.ctx)


def body_digest(body: bytes) -> bytes:
    return b"sha256:" + hashlib.sha256(body).hexdigest().encode()


def encode(payload: bytes, socket: str = "", ttl: int = 0) -> str:
    """A credential carrying ``payload``."""
    with _Context(socket, ttl) as ctx:
        cred = ctypes.c_char_p()
        buf = ctypes.create_string_buffer(payload, len(payload))
        rc = ctx.lib.munge_encode(ctypes.byref(cred), ctx.ctx, buf, len(payload))
        if rc:
            raise MungeError(rc, ctx.error(rc))
        try:
            return cred.value.decode()
        finally:
            _libc.free(ctypes.cast(cred, ctypes.c_void_p))


def decode(cred: str, socket: str = "") -> tuple[bytes, int, int]:
    """(payload, uid, gid) of a valid credential; MungeError otherwise
    (expired, replayed, forged, or munged unreachable)."""
    with _Context(socket) as ctx:
        buf, length = ctypes.c_void_p(), ctypes.c_int()
        uid, gid = ctypes.c_uint(), ctypes.c_uint()
        rc = ctx.lib.munge_decode(cred.encode(), ctx.ctx, ctypes.byref(buf),
                                  ctypes.byref(length), ctypes.byref(uid), ctypes.byref(gid))
        try:
            payload = ctypes.string_at(buf, length.value) if buf.value else b""
        finally:
            if buf.value:
                _libc.free(buf)
        if rc:
            raise MungeError(rc, ctx.error(rc))
        return payload, uid.value, gid.value


def sign_body(body: bytes, socket: str = "", ttl: int = 0) -> str:
    """The credential a hook sends with ``body``."""
    return encode(body_digest(body), socket, ttl)


def verify_body(cred: str, body: bytes, socket: str = "") -> int:
    """The uid that signed ``body``; MungeError when the credential is bad or
    was made for another body."""
    payload, uid, _gid = decode(cred, socket)
    if payload != body_digest(body):
        raise MungeError(14, "credential does not match the request body")
    return uid
