"""The sockets bound to ports, read from the kernel's text tables (/proc/net/tcp, tcp6, udp, udp6).

One reader for the three places that ask which sockets listen on a port: the listener lookup
(``collectors.listeners``), the other network namespaces' (``probes.netns``) and ``auditor
doctor``. Each line: ``sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid
timeout inode ...``, addresses as hex ``ADDRESS:PORT``, the state ``st`` as two hex digits.
"""

from __future__ import annotations

from collections.abc import Collection

TCP_LISTEN = "0A"  # the st column of a listening TCP socket
UDP_UNCONNECTED = "07"  # a bound UDP socket with no peer (TCP_CLOSE's number)


def bound_inodes(text: str, ports: Collection[int], state: str = TCP_LISTEN) -> dict[int, set[int]]:
    """Port -> inodes of the sockets in ``state`` on the ``ports`` (any local address) that a
    table's ``text`` lists. A line it cannot read is skipped; a socket with no inode (0) is left out."""
    found: dict[int, set[int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split(None, 10)
        if len(fields) < 10 or fields[3] != state:
            continue
        try:
            port, inode = int(fields[1].rpartition(":")[2], 16), int(fields[9])
        except ValueError:
            continue
        if port in ports and inode:
            found.setdefault(port, set()).add(inode)
    return found
