"""services/devtools/local_nodes' ports: free_port's are for listeners that start later (a Ray node's, a test's
server), so they lie where no outgoing connection can take them first."""

import socket

from tandem.services.devtools.local_nodes import ephemeral_ports, free_port


def test_free_ports_lie_above_the_ephemeral_range_and_nobody_listens_there():
    eph = ephemeral_ports()
    room = 65536 - eph.stop >= 1000
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port
    for port in ports:
        assert (port >= eph.stop) == room, (port, eph)
        with socket.socket() as s:
            s.bind(("", port))
