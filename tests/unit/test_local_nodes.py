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


def test_free_port_never_hands_out_a_port_twice():
    """A node's ports are drawn together before any listens: two draws of one port made `ray start` refuse the node
    ("trying to use a port number ... used by other components")."""
    from tandem.services.devtools import local_nodes

    above = 65536 - ephemeral_ports().stop
    drawn = [free_port() for _ in range(min(above, 1000) // 2)]  # ~0.5 of the room: without the rule, repeats certain
    assert len(set(drawn)) == len(drawn)
    assert set(drawn) <= local_nodes._GIVEN


def test_stop_kills_what_a_failed_node_start_left_behind():
    """A `ray start` that exits (its raylet timed out registering) leaves its processes running, not its
    children: stop finds them by the node's temporary directory on their command lines, and nothing else."""
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from tandem.services.devtools.local_nodes import naming, stop

    temp, other = tempfile.mkdtemp(prefix="ray"), tempfile.mkdtemp(prefix="ray")
    sleeper = "import time; time.sleep(300)"
    start = subprocess.Popen(["bash", "-c", f"{sys.executable} -c '{sleeper}' --temp-dir={temp} & echo $!; exit 1"],
                             stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen([sys.executable, "-c", sleeper, f"--temp-dir={other}"])
    try:
        orphan = int(start.stdout.readline())
        assert start.wait(10) == 1
        deadline = time.time() + 10  # its command line names the directory once the fork has exec'd python
        while naming(temp) != [orphan] and time.time() < deadline:
            time.sleep(0.05)
        assert naming(temp) == [orphan]
        start.temp = temp
        stop([start])
        time.sleep(0.5)
        assert naming(temp) == [] and not Path(temp).exists()
        assert bystander.poll() is None  # another node's process, untouched
    finally:
        bystander.kill()
        Path(other).rmdir()


def test_a_start_that_timed_out_is_tried_again_and_any_other_failure_is_raised_at_once():
    import pytest

    from tandem.services.devtools.local_nodes import NodeExited, again_on_timeout

    timed_out = "Exception: The current node timed out during startup. This could happen because ..."
    calls = []

    def start(fails: list[str]):
        def go():
            calls.append(1)
            if len(calls) <= len(fails):
                raise NodeExited(fails[len(calls) - 1])
            return "node"
        return go

    assert again_on_timeout(start([timed_out, timed_out]), 3) == "node" and len(calls) == 3
    calls.clear()
    with pytest.raises(NodeExited, match="timed out"):  # the third time is the last
        again_on_timeout(start([timed_out] * 3), 3)
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(NodeExited, match="address in use"):
        again_on_timeout(start(["OSError: address in use", timed_out]), 3)
    assert len(calls) == 1
