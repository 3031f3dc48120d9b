"""Drive the flowsched NCCL net plugin through ctypes, exactly as NCCL calls it.

NCCL loads a net plugin with ``dlopen(RTLD_NOW | RTLD_LOCAL)``, looks up one exported table
(``ncclNetPlugin_v12``, ``_v11`` or ``_v10``) and calls its entries from two threads: the
service thread (``init``, ``listen``, ``connect``, ``accept``, ``regMr``, the closes) and the
progress thread (``isend``, ``irecv``, ``test``). This module reproduces that contract for
tests and for the testbed, without NCCL or a GPU:

* ``connect`` and ``accept`` are non-blocking: they are called again with the *same* handle
  buffer / listen comm until they return a comm (``connect_step`` / ``accept_step`` expose
  one call, for a thread that alternates both);
* ``isend`` / ``irecv`` may return no request (retry later); ``irecv``'s request pointer is
  preset to 0x1 like NCCL >= 2.24 does, so a plugin that forgets to write it is caught;
* buffers are registered with ``regMr`` before use and kept alive until their request is done.

Typical use (two processes, the 128-byte handle carried out of band)::

    plugin = Plugin(plugin_path(), version=11)
    ctx = plugin.init(comm_id=0x1234, traffic_class=-1)
    listener = ctx.listen()                   # receiver side
    send_handle(listener.handle)              # ... to the peer
    recv_comm = listener.accept(timeout=30)
    data = recv_comm.recv_message(capacity=1 << 20)
    # the sender: send_comm = ctx.connect(handle); send_comm.send_message(b"...", tag=0)
    recv_comm.close(); ctx.finalize(); plugin.close()

The logger passed to ``init`` forwards the plugin's lines to :mod:`logging` (logger
``flowsched.nccl.plugin``). NCCL's logger is variadic; the flowsched plugin always calls it
with the format ``"%s"`` and one string, which the callback reads as a sixth fixed argument.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from typing import Any

HANDLE_SIZE = 128
PTR_HOST = 0x1
PTR_CUDA = 0x2
OPTIONAL_RECV_COMPLETION = 0x1
TRAFFIC_CLASS_UNDEF = -1
MAX_NET_SIZE_BYTES = 1 << 40  # NCCL_MAX_NET_SIZE_BYTES: the largest maxP2pBytes/maxCollBytes
NET_DEVICE_HOST = 0
NET_DEVICE_UNPACK = 1
NET_DEVICE_UNPACK_VERSION = 0x7
SUPPORTED_VERSIONS = (10, 11, 12)

RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}

_log = logging.getLogger("flowsched.nccl.plugin")


class PluginError(RuntimeError):
    """A plugin entry point returned something other than ncclSuccess."""

    def __init__(self, call: str, code: int) -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call} returned {RESULT_NAMES.get(code, code)} ({code})")


class PluginRejected(RuntimeError):
    """The plugin answered init/devices/getProperties with something NCCL refuses: NCCL would
    disable it (no device), skip it (device type) or fail the connection setup (size limits)."""


class PluginTimeout(TimeoutError):
    """A retried call (connect, accept, post, test) did not complete in time."""


# ---- ABI: the structs and tables (field order is the ABI) ----------------------------------

_vp = ctypes.c_void_p
_pvp = ctypes.POINTER(ctypes.c_void_p)
_res = ctypes.c_int
LOGGER = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_char_p,
)


def _vprops(ndevs: int) -> type[ctypes.Structure]:
    return type(
        f"VDeviceProps{ndevs}",
        (ctypes.Structure,),
        {"_fields_": [("ndevs", ctypes.c_int), ("devs", ctypes.c_int * ndevs)]},
    )


_PROPS_COMMON: list[tuple[str, Any]] = [
    ("name", ctypes.c_char_p),
    ("pciPath", ctypes.c_char_p),
    ("guid", ctypes.c_uint64),
    ("ptrSupport", ctypes.c_int),
    ("regIsGlobal", ctypes.c_int),
    ("forceFlush", ctypes.c_int),
    ("speed", ctypes.c_int),
    ("port", ctypes.c_int),
    ("latency", ctypes.c_float),
    ("maxComms", ctypes.c_int),
    ("maxRecvs", ctypes.c_int),
    ("netDeviceType", ctypes.c_int),
    ("netDeviceVersion", ctypes.c_int),
]


class PropertiesV10(ctypes.Structure):
    _fields_ = [
        *_PROPS_COMMON,
        ("vProps", _vprops(4)),
        ("maxP2pBytes", ctypes.c_size_t),
        ("maxCollBytes", ctypes.c_size_t),
    ]


class PropertiesV11(ctypes.Structure):
    _fields_ = [
        *_PROPS_COMMON,
        ("vProps", _vprops(4)),
        ("maxP2pBytes", ctypes.c_size_t),
        ("maxCollBytes", ctypes.c_size_t),
        ("maxMultiRequestSize", ctypes.c_int),
    ]


class PropertiesV12(ctypes.Structure):
    _fields_ = [
        *_PROPS_COMMON,
        ("vProps", _vprops(8)),
        ("maxP2pBytes", ctypes.c_size_t),
        ("maxCollBytes", ctypes.c_size_t),
        ("maxMultiRequestSize", ctypes.c_int),
        ("railId", ctypes.c_int16),
        ("planeId", ctypes.c_int16),
    ]


class CommConfig(ctypes.Structure):
    _fields_ = [("trafficClass", ctypes.c_int)]


class CommAttr(ctypes.Structure):
    _fields_ = [
        ("maxConcurrentPeers", ctypes.c_int32),
        ("minConcurrentPeers", ctypes.c_int32),
        ("maxFlowsPerPeer", ctypes.c_int32),
        ("minFlowsPerPeer", ctypes.c_int32),
    ]


class NetAttr(ctypes.Structure):
    _fields_ = [
        ("sendCommAttr", CommAttr),
        ("recvCommAttr", CommAttr),
        ("op", ctypes.c_uint32),
        ("algo", ctypes.c_uint32),
        ("proto", ctypes.c_uint32),
    ]


def _fn(*args: Any) -> Any:
    return ctypes.CFUNCTYPE(_res, *args)


_SHARED_TAIL: list[tuple[str, Any]] = [
    ("accept", _fn(_vp, _pvp, _pvp)),
    ("regMr", _fn(_vp, _vp, ctypes.c_size_t, ctypes.c_int, _pvp)),
    (
        "regMrDmaBuf",
        _fn(_vp, _vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_int, _pvp),
    ),
    ("deregMr", _fn(_vp, _vp)),
    ("isend", _fn(_vp, _vp, ctypes.c_size_t, ctypes.c_int, _vp, _vp, _pvp)),
    (
        "irecv",
        _fn(
            _vp,
            ctypes.c_int,
            _pvp,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_int),
            _pvp,
            _pvp,
            _pvp,
        ),
    ),
    ("iflush", _fn(_vp, ctypes.c_int, _pvp, ctypes.POINTER(ctypes.c_int), _pvp, _pvp)),
    ("test", _fn(_vp, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int))),
    ("closeSend", _fn(_vp)),
    ("closeRecv", _fn(_vp)),
    ("closeListen", _fn(_vp)),
    ("getDeviceMr", _fn(_vp, _vp, _pvp)),
    ("irecvConsumed", _fn(_vp, ctypes.c_int, _vp)),
]


class NetV10(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("init", _fn(LOGGER, _vp)),
        ("devices", _fn(ctypes.POINTER(ctypes.c_int))),
        ("getProperties", _fn(ctypes.c_int, ctypes.POINTER(PropertiesV10))),
        ("listen", _fn(ctypes.c_int, _vp, _pvp)),
        ("connect", _fn(ctypes.c_int, ctypes.POINTER(CommConfig), _vp, _pvp, _pvp)),
        *_SHARED_TAIL,
        ("makeVDevice", _fn(ctypes.POINTER(ctypes.c_int), _vp)),
    ]


def _net_v11_like(props: type[ctypes.Structure], name: str) -> type[ctypes.Structure]:
    fields = [
        ("name", ctypes.c_char_p),
        ("init", _fn(_pvp, ctypes.c_uint64, ctypes.POINTER(CommConfig), LOGGER, _vp)),
        ("devices", _fn(ctypes.POINTER(ctypes.c_int))),
        ("getProperties", _fn(ctypes.c_int, ctypes.POINTER(props))),
        ("listen", _fn(_vp, ctypes.c_int, _vp, _pvp)),
        ("connect", _fn(_vp, ctypes.c_int, _vp, _pvp, _pvp)),
        *_SHARED_TAIL,
        ("makeVDevice", _fn(ctypes.POINTER(ctypes.c_int), _vp)),
        ("finalize", _fn(_vp)),
        ("setNetAttr", _fn(_vp, ctypes.POINTER(NetAttr))),
    ]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


NetV11 = _net_v11_like(PropertiesV11, "NetV11")
NetV12 = _net_v11_like(PropertiesV12, "NetV12")
_TABLES: dict[int, tuple[type[ctypes.Structure], type[ctypes.Structure]]] = {
    10: (NetV10, PropertiesV10),
    11: (NetV11, PropertiesV11),
    12: (NetV12, PropertiesV12),
}


def _log_line(level: int, flags: int, file: bytes, line: int, fmt: bytes, text: bytes) -> None:
    del flags, fmt
    py_level = logging.WARNING if level == 2 else logging.DEBUG if level == 5 else logging.INFO
    _log.log(
        py_level,
        "%s:%d %s",
        (file or b"?").decode(),
        line,
        (text or b"").decode("utf-8", "replace"),
    )


#: the logger handed to init; module-level so that it outlives every plugin that holds it
_FORWARD_LOG: Any = LOGGER(_log_line)


def _check(call: str, code: int) -> None:
    if code != 0:
        raise PluginError(call, code)


def _check_properties(dev: int, props: dict[str, Any]) -> None:
    kind, version = props["netDeviceType"], props["netDeviceVersion"]
    if kind != NET_DEVICE_HOST and (kind, version) != (
        NET_DEVICE_UNPACK,
        NET_DEVICE_UNPACK_VERSION,
    ):
        raise PluginRejected(f"device {dev}: netDeviceType {kind} version {version}")
    for name in ("maxP2pBytes", "maxCollBytes"):
        if not 0 < props[name] <= MAX_NET_SIZE_BYTES:
            raise PluginRejected(f"device {dev}: {name} {props[name]} outside (0, 1 TiB]")


def _deadline(timeout: float) -> Callable[[], bool]:
    end = time.monotonic() + timeout
    return lambda: time.monotonic() > end


# ---- the driver ------------------------------------------------------------------------------


class Plugin:
    """One dlopen of the plugin library and one of its exported tables (v10, v11 or v12)."""

    def __init__(self, path: str | os.PathLike[str], version: int = 11) -> None:
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"version must be one of {SUPPORTED_VERSIONS}, got {version}")
        self.path = os.fspath(path)
        self.version = version
        self._lib: ctypes.CDLL | None = ctypes.CDLL(self.path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        table_type, self._props_type = _TABLES[version]
        self.table: Any = table_type.in_dll(self._lib, f"ncclNetPlugin_v{version}")
        self.name: str = self.table.name.decode()
        self._v10_ready = False

    def init(self, comm_id: int = 0, traffic_class: int = TRAFFIC_CLASS_UNDEF) -> Context:
        """``init`` for one communicator (v11/v12), or the once-per-process v10 ``init``.

        Also calls ``devices`` and ``getProperties`` for each device, as NCCL does, and checks
        what NCCL checks there: at least one device (else NCCL disables the plugin), a host (or
        UNPACK) device type (else NCCL skips it) and ``maxP2pBytes``/``maxCollBytes`` in
        (0, 1 TiB] (else NCCL's proxy setup fails); :class:`PluginRejected` otherwise.
        """
        ctx = ctypes.c_void_p()
        if self.version == 10:
            if not self._v10_ready:
                _check("init", self.table.init(_FORWARD_LOG, None))
                self._v10_ready = True
        else:
            config = CommConfig(traffic_class)
            _check(
                "init",
                self.table.init(
                    ctypes.byref(ctx), comm_id, ctypes.byref(config), _FORWARD_LOG, None
                ),
            )
        context = Context(self, ctx, comm_id, traffic_class)
        try:
            ndev = self.devices()
            if ndev <= 0:
                raise PluginRejected(f"devices returned {ndev}: NCCL disables the plugin")
            for dev in range(ndev):
                _check_properties(dev, self.properties(dev))
        except (PluginError, PluginRejected):
            context.finalize()  # NCCL finalizes a context whose plugin it then refuses
            raise
        return context

    def devices(self) -> int:
        """Number of devices (interfaces) the plugin offers."""
        count = ctypes.c_int()
        _check("devices", self.table.devices(ctypes.byref(count)))
        return count.value

    def properties(self, dev: int) -> dict[str, Any]:
        """``getProperties(dev)`` as a dict of the struct's fields."""
        props = self._props_type()
        _check("getProperties", self.table.getProperties(dev, ctypes.byref(props)))
        out: dict[str, Any] = {}
        for field in props._fields_:
            name = field[0]
            value = getattr(props, name)
            if name == "vProps":
                value = list(value.devs[: value.ndevs])
            elif isinstance(value, bytes):
                value = value.decode()
            out[name] = value
        return out

    def close(self) -> None:
        """dlclose the library (NCCL 2.27+ unloads plugins after the last communicator)."""
        if self._lib is not None:
            import _ctypes

            _ctypes.dlclose(self._lib._handle)
            self._lib = None
            self.table = None


class Context:
    """A per-communicator context (v11/v12), or the process-wide one of v10."""

    def __init__(self, plugin: Plugin, ctx: ctypes.c_void_p, comm_id: int, tc: int) -> None:
        self.plugin = plugin
        self._ctx = ctx
        self.comm_id = comm_id
        self.traffic_class = tc

    @property
    def _table(self) -> Any:
        return self.plugin.table

    def listen(self, dev: int = 0) -> Listener:
        """``listen``: returns the listener, whose ``handle`` (128 bytes) goes to the peer."""
        handle = ctypes.create_string_buffer(HANDLE_SIZE)
        comm = ctypes.c_void_p()
        if self.plugin.version == 10:
            _check("listen", self._table.listen(dev, handle, ctypes.byref(comm)))
        else:
            _check("listen", self._table.listen(self._ctx, dev, handle, ctypes.byref(comm)))
        if not comm.value:
            raise PluginError("listen (no comm)", 3)
        return Listener(self, comm, handle.raw)

    def connector(self, handle: bytes, dev: int = 0) -> Connector:
        """A connection in progress; call ``step()`` until it returns a SendComm."""
        return Connector(self, handle, dev)

    def connect(self, handle: bytes, dev: int = 0, timeout: float = 30.0) -> SendComm:
        """Call ``connect`` with the same handle buffer until it yields a send comm."""
        connector = self.connector(handle, dev)
        expired = _deadline(timeout)
        while (comm := connector.step()) is None:
            if expired():
                raise PluginTimeout("connect did not complete")
        return comm

    def set_net_attr(self, op: int, algo: int = 0xFFFFFFFF, proto: int = 0xFFFFFFFF) -> None:
        """``setNetAttr`` (v11/v12): NCCL's per-context operation hint."""
        if self.plugin.version == 10:
            raise ValueError("setNetAttr does not exist in API v10")
        undef = CommAttr(-1, -1, -1, -1)
        attr = NetAttr(undef, undef, op, algo, proto)
        _check("setNetAttr", self._table.setNetAttr(self._ctx, ctypes.byref(attr)))

    def finalize(self) -> None:
        """``finalize`` (v11/v12; v10 has none)."""
        if self.plugin.version != 10 and self._ctx.value:
            _check("finalize", self._table.finalize(self._ctx))
            self._ctx = ctypes.c_void_p()


class Connector:
    """The connect state machine from NCCL's side: one handle buffer, reused on every call."""

    def __init__(self, ctx: Context, handle: bytes, dev: int) -> None:
        if len(handle) != HANDLE_SIZE:
            raise ValueError(f"handle must be {HANDLE_SIZE} bytes, got {len(handle)}")
        self.ctx = ctx
        self.dev = dev
        self._handle = ctypes.create_string_buffer(handle, HANDLE_SIZE)
        self._config = CommConfig(ctx.traffic_class)

    def step(self) -> SendComm | None:
        """One ``connect`` call; the comm once it is complete, else None."""
        table = self.ctx.plugin.table
        comm = ctypes.c_void_p()
        dev_handle = ctypes.c_void_p()
        if self.ctx.plugin.version == 10:
            code = table.connect(
                self.dev,
                ctypes.byref(self._config),
                self._handle,
                ctypes.byref(comm),
                ctypes.byref(dev_handle),
            )
        else:
            code = table.connect(
                self.ctx._ctx, self.dev, self._handle, ctypes.byref(comm), ctypes.byref(dev_handle)
            )
        _check("connect", code)
        return SendComm(self.ctx, comm) if comm.value else None


class Listener:
    """A listen comm; the accept state lives inside it between ``accept_step`` calls."""

    def __init__(self, ctx: Context, comm: ctypes.c_void_p, handle: bytes) -> None:
        self.ctx = ctx
        self._comm = comm
        self.handle = handle

    def accept_step(self) -> RecvComm | None:
        """One ``accept`` call; the comm once a connection is complete, else None."""
        comm = ctypes.c_void_p()
        dev_handle = ctypes.c_void_p()
        _check(
            "accept",
            self.ctx.plugin.table.accept(self._comm, ctypes.byref(comm), ctypes.byref(dev_handle)),
        )
        return RecvComm(self.ctx, comm) if comm.value else None

    def accept(self, timeout: float = 30.0, close: bool = True) -> RecvComm:
        """Call ``accept`` until a connection completes; then ``closeListen`` (as NCCL does)."""
        expired = _deadline(timeout)
        while (comm := self.accept_step()) is None:
            if expired():
                raise PluginTimeout("accept did not complete")
            time.sleep(0.0005)
        if close:
            self.close()
        return comm

    def close(self) -> None:
        """``closeListen`` (idempotent)."""
        if self._comm.value:
            _check("closeListen", self.ctx.plugin.table.closeListen(self._comm))
            self._comm = ctypes.c_void_p()


class Buffer:
    """A host buffer registered with ``regMr`` on one comm."""

    def __init__(self, comm: _Comm, size: int) -> None:
        self.comm = comm
        self.size = size
        self.memory = (ctypes.c_char * max(size, 1))()
        self.mhandle = ctypes.c_void_p()
        _check(
            "regMr",
            comm._table.regMr(
                comm._comm, self.memory, max(size, 1), PTR_HOST, ctypes.byref(self.mhandle)
            ),
        )

    def write(self, data: bytes) -> None:
        """Copy ``data`` to the start of the buffer."""
        ctypes.memmove(self.memory, data, len(data))

    def read(self, size: int) -> bytes:
        """The first ``size`` bytes."""
        return ctypes.string_at(self.memory, size)

    def release(self) -> None:
        """``deregMr``."""
        if self.mhandle.value:
            _check("deregMr", self.comm._table.deregMr(self.comm._comm, self.mhandle))
            self.mhandle = ctypes.c_void_p()


class Request:
    """An outstanding isend/irecv; it and its buffer stay alive (held by the comm) until it
    is done or the comm is closed, even if the caller drops it: the plugin's helper threads
    may write a posted receive's buffer at any time until then, as NCCL's contract allows."""

    def __init__(self, comm: _Comm, handle: ctypes.c_void_p, buffer: Buffer) -> None:
        self.comm = comm
        self._handle = handle
        self.buffer = buffer
        self.done = False
        self.size = -1
        comm._in_flight.add(self)

    def test(self) -> bool:
        """One ``test`` call; True once complete (``size`` then holds the byte count)."""
        if self.done:
            return True
        done = ctypes.c_int()
        size = ctypes.c_int(-1)
        _check("test", self.comm._table.test(self._handle, ctypes.byref(done), ctypes.byref(size)))
        if done.value:
            self.done = True
            self.size = size.value
            self.comm._in_flight.discard(self)
        return self.done

    def wait(self, timeout: float = 30.0) -> int:
        """Poll ``test`` until done; returns the size the plugin reported."""
        expired = _deadline(timeout)
        while not self.test():
            if expired():
                raise PluginTimeout("request did not complete")
            time.sleep(0)
        return self.size


class _Comm:
    def __init__(self, ctx: Context, comm: ctypes.c_void_p) -> None:
        self.ctx = ctx
        self._comm = comm
        self._in_flight: set[Request] = set()

    @property
    def _table(self) -> Any:
        return self.ctx.plugin.table

    def register(self, size: int) -> Buffer:
        """Allocate and ``regMr`` a host buffer of ``size`` bytes."""
        return Buffer(self, size)


class SendComm(_Comm):
    """A send comm (from connect)."""

    def isend(self, buffer: Buffer, size: int, tag: int = 0) -> Request | None:
        """One ``isend``; None when the plugin has no free request slot (retry later)."""
        request = ctypes.c_void_p()
        _check(
            "isend",
            self._table.isend(
                self._comm, buffer.memory, size, tag, buffer.mhandle, None, ctypes.byref(request)
            ),
        )
        return Request(self, request, buffer) if request.value else None

    def post(self, buffer: Buffer, size: int, tag: int = 0, timeout: float = 30.0) -> Request:
        """``isend``, retried until the plugin accepts it."""
        expired = _deadline(timeout)
        while (request := self.isend(buffer, size, tag)) is None:
            if expired():
                raise PluginTimeout("isend was never accepted")
            time.sleep(0)
        return request

    def send_message(self, data: bytes, tag: int = 0, timeout: float = 30.0) -> int:
        """Send ``data`` as one message and wait for completion; returns the size sent."""
        buffer = self.register(len(data))
        buffer.write(data)
        try:
            return self.post(buffer, len(data), tag, timeout).wait(timeout)
        finally:
            buffer.release()

    def close(self) -> None:
        """``closeSend`` (idempotent)."""
        if self._comm.value:
            _check("closeSend", self._table.closeSend(self._comm))
            self._comm = ctypes.c_void_p()
            self._in_flight.clear()


class RecvComm(_Comm):
    """A receive comm (from accept)."""

    def irecv(self, buffer: Buffer, capacity: int, tag: int = 0) -> Request | None:
        """One ``irecv`` of up to ``capacity`` bytes; None when no slot is free.

        The request pointer is preset to 0x1 first, as NCCL does for LL/LL128 receives; the
        plugin must overwrite it.
        """
        request = ctypes.c_void_p(OPTIONAL_RECV_COMPLETION)
        data = (ctypes.c_void_p * 1)(ctypes.cast(buffer.memory, ctypes.c_void_p))
        sizes = (ctypes.c_size_t * 1)(capacity)
        tags = (ctypes.c_int * 1)(tag)
        mhandles = (ctypes.c_void_p * 1)(buffer.mhandle)
        _check(
            "irecv",
            self._table.irecv(
                self._comm, 1, data, sizes, tags, mhandles, None, ctypes.byref(request)
            ),
        )
        if request.value == OPTIONAL_RECV_COMPLETION:
            raise PluginError("irecv left *request == 0x1", 3)
        return Request(self, request, buffer) if request.value else None

    def post(self, buffer: Buffer, capacity: int, tag: int = 0, timeout: float = 30.0) -> Request:
        """``irecv``, retried until the plugin accepts it."""
        expired = _deadline(timeout)
        while (request := self.irecv(buffer, capacity, tag)) is None:
            if expired():
                raise PluginTimeout("irecv was never accepted")
            time.sleep(0)
        return request

    def recv_message(self, capacity: int, tag: int = 0, timeout: float = 30.0) -> bytes:
        """Receive one message of at most ``capacity`` bytes and return its bytes."""
        buffer = self.register(capacity)
        try:
            size = self.post(buffer, capacity, tag, timeout).wait(timeout)
            return buffer.read(size)
        finally:
            buffer.release()

    def close(self) -> None:
        """``closeRecv`` (idempotent)."""
        if self._comm.value:
            _check("closeRecv", self._table.closeRecv(self._comm))
            self._comm = ctypes.c_void_p()
            self._in_flight.clear()


def connect_pair(
    ctx: Context, dev: int = 0, timeout: float = 30.0, to: Context | None = None
) -> tuple[SendComm, RecvComm]:
    """Connect a context to itself (or to the context ``to``, e.g. another rank's) from ONE
    thread, alternating connect and accept calls.

    This is NCCL's GDR-probe pattern; it only completes if neither call ever blocks.
    """
    listener = (to or ctx).listen(dev)
    connector = ctx.connector(listener.handle, dev)
    send: SendComm | None = None
    recv: RecvComm | None = None
    expired = _deadline(timeout)
    while send is None or recv is None:
        send = send or connector.step()
        recv = recv or listener.accept_step()
        if expired():
            raise PluginTimeout("alternating connect/accept did not complete")
    listener.close()
    return send, recv


def wait_all(requests: list[Request], timeout: float = 30.0) -> list[int]:
    """Poll several requests round-robin from one thread (e.g. a send and its receive on a
    ``connect_pair``) until all are done; returns their sizes."""
    expired = _deadline(timeout)
    while not all([request.test() for request in requests]):
        if expired():
            raise PluginTimeout("requests did not complete")
    return [request.size for request in requests]


def loopback_message(
    send: SendComm,
    recv: RecvComm,
    data: bytes,
    capacity: int | None = None,
    tag: int = 0,
    timeout: float = 30.0,
) -> bytes:
    """Send ``data`` over a pair connected in this process and return what arrived."""
    capacity = len(data) if capacity is None else capacity
    out, into = send.register(len(data)), recv.register(capacity)
    out.write(data)
    try:
        requests = [
            recv.post(into, capacity, tag, timeout),
            send.post(out, len(data), tag, timeout),
        ]
        size = wait_all(requests, timeout)[0]
        return into.read(size)
    finally:
        out.release()
        into.release()


def stream(
    comm: SendComm | RecvComm,
    message_size: int,
    *,
    in_flight: int = 8,
    until: Callable[[], bool],
    on_complete: Callable[[int], None] | None = None,
) -> int:
    """Keep ``in_flight`` messages of ``message_size`` bytes posted on ``comm`` (sends or
    receives), as NCCL's proxy does for one connection, until ``until()`` is true; calls
    ``on_complete(size)`` for each completed message. Returns the number completed.

    Raises PluginError when the connection fails (e.g. the peer went away).
    """
    buffers = [comm.register(message_size) for _ in range(in_flight)]
    requests = [comm.post(b, message_size) for b in buffers]  # type: ignore[arg-type]
    completed = 0
    head = 0
    while not until():
        request = requests[head]
        if not request.test():
            continue
        completed += 1
        if on_complete is not None:
            on_complete(request.size)
        requests[head] = comm.post(request.buffer, message_size)  # type: ignore[arg-type]
        head = (head + 1) % in_flight
    return completed
