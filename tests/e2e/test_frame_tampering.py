"""Someone on the path between a real agent and a real coordinator (no TLS) alters one frame
after the handshake: from protocol version 5 the receiving end notices (its MAC), drops the
connection with a log line that says so, and the agent reconnects and carries on."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

from e2e_helpers import cleanup, scrape, start_agent, start_coordinator, total, wait_for

from flowsched.protocol._framing import HEADER_SIZE


class TamperingRelay:
    """A TCP relay on 127.0.0.1 to ``target``. On the connections listed in ``tamper``
    (connection index -> (direction, frame index)), it flips one bit in the body of that frame
    of that direction ("down": coordinator to agent, "up": agent to coordinator; frames
    counted from 0, the handshake's included); everything else passes unchanged."""

    def __init__(self, target: int, tamper: dict[int, tuple[str, int]]) -> None:
        self.target, self.tamper = target, tamper
        self.tampered: list[tuple[int, str, int]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        for index in range(1 << 30):
            try:
                agent, _ = self._listener.accept()
            except OSError:  # closed
                return
            coordinator = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            coordinator.settimeout(None)
            self._sockets += [agent, coordinator]
            plan = self.tamper.get(index)
            for direction, src, dst in (("up", agent, coordinator), ("down", coordinator, agent)):
                flip = plan[1] if plan is not None and plan[0] == direction else None
                args = (index, direction, src, dst, flip)
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self, index: int, direction: str, src: socket.socket, dst: socket.socket, flip: int | None
    ) -> None:
        pending, count = bytearray(), 0
        try:
            while data := src.recv(65536):
                pending += data
                while len(pending) >= HEADER_SIZE:
                    end = HEADER_SIZE + int.from_bytes(pending[:HEADER_SIZE], "big")
                    if len(pending) < end:
                        break
                    frame = bytearray(pending[:end])
                    del pending[:end]
                    if count == flip:  # a byte in the middle: the body's, not the MAC's
                        frame[HEADER_SIZE + (end - HEADER_SIZE - 16) // 2] ^= 0x01
                        self.tampered.append((index, direction, count))
                    count += 1
                    dst.sendall(frame)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            sock.close()


def test_a_frame_altered_on_the_path_is_caught_and_the_agent_reconnects(
    tmp_path: Path, token: Path
) -> None:
    with cleanup() as started:
        coordinator = start_coordinator(tmp_path, token)
        started.append(coordinator)
        # connection 0: the coordinator's first frame after its welcome (challenge 0, welcome
        # 1); connection 1: the agent's first after its auth (hello 0, auth 1, resync 2)
        relay = TamperingRelay(int(coordinator.fields["port"]), {0: ("down", 2), 1: ("up", 2)})
        try:
            agent = start_agent(tmp_path, token, relay.port)
            started.append(agent)
            agent_log = tmp_path / "agent-n1.log"
            metrics = coordinator.fields["mport"]
            wait_for(lambda: len(relay.tampered) == 2, 30, "both frames to be altered")
            wait_for(
                lambda: agent_log.read_text().count("connected to the coordinator") >= 3,
                30,
                "the agent to connect a third time",
            )
            wait_for(
                lambda: total(scrape(metrics), "flowsched_coordinator_agents_connected") == 1,
                10,
                "the coordinator to count the agent connected",
            )
            counted = scrape(metrics)
        finally:
            relay.close()
    assert relay.tampered == [(0, "down", 2), (1, "up", 2)]
    text = agent_log.read_text()
    assert "coordinator link lost: bad_mac: frame MAC: wrong frame MAC" in text, text  # its own
    assert "coordinator link lost: coordinator error bad_mac: frame MAC" in text  # told
    coordinator_log = (tmp_path / "coordinator.log").read_text()
    assert "node=n1 state=error: bad_mac: frame MAC: wrong frame MAC" in coordinator_log
    assert total(counted, "flowsched_coordinator_closed_connections_total", reason="bad_mac") >= 1
    assert "protocol version 5, frames sealed" in text
