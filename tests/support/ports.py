"""A free TCP port on 127.0.0.1 (rendezvous and HTTP servers in tests), and waiting for a server
launched in other processes to answer."""
import socket
import time
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(url: str, alive: Callable[[], bool], why: Callable[[], str], timeout: float) -> None:
    """Poll ``url``/v1/models until it answers 200; AssertionError (with ``why()``, e.g. the
    processes' output) when ``alive()`` turns false or ``timeout`` seconds pass."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        assert alive(), "the server's processes exited before serving\n" + why()
        assert time.monotonic() < deadline, "serve did not come up\n" + why()
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
