"""netem's ``delay`` and ``loss`` where the kernel lacks netem: an NFQUEUE verdict program.

Some VM kernels (this one: ``CONFIG_NET_SCH_NETEM`` is not set) have no netem qdisc, but
netfilter's userspace queue is built in. Run inside a host's namespace
(``python -m tests.multihost.delay_queue --queue 7 --delay 0.2 --loss 0.2``), it takes every
packet iptables sends to that queue and accepts it ``--delay`` seconds later, or drops it with
probability ``--loss``: the same per-packet behaviour as ``tc netem delay 200ms loss 20%``.
It speaks the nfnetlink_queue protocol directly (``linux/netfilter/nfnetlink_queue.h``) over a
netlink socket, so it needs no library. It prints ``ready`` once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    # nfgenmsg: family, version 0, res_id = queue number (big-endian).
    body = struct.pack("=BBH", socket.AF_INET, 0, socket.htons(queue)) + attrs
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0)
    return header + body


def bind(sock: socket.socket, queue: int) -> None:
    """Bind ``queue`` and ask for packet metadata only (the id is all a verdict needs)."""
    command = struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, socket.AF_INET)
    params = struct.pack("!IB", 0, NFQNL_COPY_META)
    for attr in (_attr(NFQA_CFG_CMD, command), _attr(NFQA_CFG_PARAMS, params)):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attr, NLM_F_REQUEST | NLM_F_ACK))
        reply = sock.recv(65536)
        kind = struct.unpack_from("=H", reply, 4)[0]
        error = struct.unpack_from("=i", reply, 16)[0] if kind == NLMSG_ERROR else 0
        if error:
            raise OSError(-error, f"nfnetlink_queue config refused: errno {-error}")


def packet_ids(data: bytes) -> list[int]:
    """The packet ids in one netlink datagram (it may hold several messages)."""
    ids, offset = [], 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind & 0xFF == NFQNL_MSG_PACKET and kind >> 8 == NFNL_SUBSYS_QUEUE:
            position = offset + 20  # after nlmsghdr and nfgenmsg
            while position + 4 <= offset + length:
                attr_length, attr_kind = struct.unpack_from("=HH", data, position)
                if attr_length < 4:
                    break
                if attr_kind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, position + 4)[0])
                position += attr_length + (-attr_length % 4)
        offset += length + (-length % 4)
    return ids


async def serve(queue: int, delay: float, loss: float) -> None:
    """Give every queued packet its verdict: drop with probability ``loss``, else accept late."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    bind(sock, queue)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def verdict(packet_id: int, decision: int) -> None:
        attr = _attr(NFQA_VERDICT_HDR, struct.pack("!II", decision, packet_id))
        sock.send(_message(NFQNL_MSG_VERDICT, queue, attr))

    def readable() -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        for packet_id in packet_ids(data):
            if random.random() < loss:
                verdict(packet_id, NF_DROP)
            else:
                loop.call_later(delay, verdict, packet_id, NF_ACCEPT)

    loop.add_reader(sock.fileno(), readable)
    print("ready", flush=True)
    await stop.wait()


def main() -> None:
    """Parse the options and give verdicts until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds per packet")
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability")
    args = parser.parse_args()
    asyncio.run(serve(args.queue, args.delay, args.loss))


if __name__ == "__main__":
    main()
