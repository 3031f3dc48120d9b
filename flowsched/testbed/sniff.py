"""Timestamps of DSCP changes as packets leave the bottleneck ports (AF_PACKET).

An ``AF_PACKET`` socket on a shaped port sees outgoing packets when the qdisc hands them to the
device, i.e. when they leave the htb class. For every TCP connection the sniffer records each
change of the TOS byte: (kernel timestamp, connection, new TOS). The promotion latency of a
flow is the time from the controller's decision to the first packet of the flow that leaves in
the new class.

A classic BPF filter keeps the cost low on two shared cores: only outgoing IPv4 TCP packets,
only the first 96 bytes, and only a random 1-in-``sample`` of them (``SKF_AD_RANDOM``). At
200 Mbit/s a flow that owns the link sends ~16 packets per ms, so sampling 1 in 4 adds about
0.25 ms of error to a promotion it measures. Timestamps come from the kernel
(``SO_TIMESTAMPNS``, CLOCK_REALTIME) and are converted to CLOCK_MONOTONIC.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import selectors
import signal
import socket
import struct
import time
from pathlib import Path
from types import FrameType

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
SO_TIMESTAMPNS = 35
SCM_TIMESTAMPNS = SO_TIMESTAMPNS
PACKET_OUTGOING = 4
SKF_AD_OFF = -0x1000
SKF_AD_PKTTYPE = 4
SKF_AD_RANDOM = 56
SNAPLEN = 96

# classic BPF opcodes
_LD_W_ABS, _LD_H_ABS, _LD_B_ABS = 0x20, 0x28, 0x30
_ALU_AND_K, _JEQ_K, _RET_K = 0x54, 0x15, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = (
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    )


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter)))


def bpf_program(sample: int) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k): outgoing IPv4 TCP, 1 in ``sample`` (a power of two), first 96 bytes."""
    if sample < 1 or sample & (sample - 1):
        raise ValueError(f"sample must be a power of two, got {sample}")
    ad = 1 << 32
    return [
        (_LD_W_ABS, 0, 0, ad + SKF_AD_OFF + SKF_AD_PKTTYPE),
        (_JEQ_K, 0, 8, PACKET_OUTGOING),
        (_LD_H_ABS, 0, 0, 12),
        (_JEQ_K, 0, 6, 0x0800),
        (_LD_B_ABS, 0, 0, 23),
        (_JEQ_K, 0, 4, 6),
        (_LD_W_ABS, 0, 0, ad + SKF_AD_OFF + SKF_AD_RANDOM),
        (_ALU_AND_K, 0, 0, sample - 1),
        (_JEQ_K, 0, 1, 0),
        (_RET_K, 0, 0, SNAPLEN),
        (_RET_K, 0, 0, 0),
    ]


def _attach(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    insns = (_SockFilter * len(program))(
        *[_SockFilter(c, t, f, k & 0xFFFFFFFF) for c, t, f, k in program]
    )
    prog = _SockFprog(len(program), insns)
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(prog))  # type: ignore[call-overload]


def open_port(dev: str, sample: int) -> socket.socket:
    """A non-blocking AF_PACKET socket on ``dev`` with the sampling filter."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    _attach(sock, bpf_program(sample))
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind((dev, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def parse(frame: bytes) -> tuple[str, int, str, int, int] | None:
    """(src, sport, dst, dport, tos) of an Ethernet/IPv4/TCP frame, else None."""
    if len(frame) < 38 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return None
    ihl = (frame[14] & 0x0F) * 4
    if len(frame) < 14 + ihl + 4:
        return None
    sport, dport = struct.unpack_from("!HH", frame, 14 + ihl)
    src, dst = socket.inet_ntoa(frame[26:30]), socket.inet_ntoa(frame[30:34])
    return src, sport, dst, dport, frame[15]


class Recorder:
    """Per-connection TOS transitions, in CLOCK_MONOTONIC nanoseconds."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.transitions: list[tuple[int, str, int]] = []
        self.packets = 0
        self._offset = time.time_ns() - time.monotonic_ns()

    def packet(self, frame: bytes, realtime_ns: int | None) -> None:
        fields = parse(frame)
        if fields is None:
            return
        self.packets += 1
        src, sport, dst, dport, tos = fields
        key = f"{src}:{sport}>{dst}:{dport}"
        if self.last.get(key) != tos:
            self.last[key] = tos
            mono = (realtime_ns - self._offset) if realtime_ns else time.monotonic_ns()
            self.transitions.append((mono, key, tos))


def _timestamp(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack_from("qq", data)
            return int(sec * 1_000_000_000 + nsec)
    return None


def run(devs: list[str], sample: int, out: Path) -> None:
    """Capture on ``devs`` until SIGTERM/SIGINT, then write the transitions to ``out``."""
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    recorder, sel = Recorder(), selectors.DefaultSelector()
    for dev in devs:
        sel.register(open_port(dev, sample), selectors.EVENT_READ)
    out.with_suffix(".ready").write_text("ready")
    while not stop:
        for key, _ in sel.select(0.2):
            _drain(key.fileobj, recorder)  # type: ignore[arg-type]
    out.write_text(
        json.dumps(
            {"sample": sample, "packets": recorder.packets, "transitions": recorder.transitions}
        )
    )


def _drain(sock: socket.socket, recorder: Recorder) -> None:
    for _ in range(256):
        try:
            frame, ancillary, _, _ = sock.recvmsg(SNAPLEN, 64)
        except (BlockingIOError, InterruptedError):
            return
        recorder.packet(frame, _timestamp(ancillary))


def main(argv: list[str] | None = None) -> int:
    """``python -m flowsched.testbed.sniff --out F [--sample N] DEV...`` (inside a namespace)."""
    parser = argparse.ArgumentParser(prog="flowsched.testbed.sniff")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sample", type=int, default=4)
    parser.add_argument("devs", nargs="+")
    args = parser.parse_args(argv)
    run(args.devs, args.sample, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
