"""The sandfleet Python SDK: async first, with a blocking twin of the same surface.

::

    from sandfleet.sdk import AsyncClient, Client

    async with AsyncClient() as client:                 # SANDFLEET_URL or http://127.0.0.1:7070
        result = await client.run("echo hi", image="python:3.11")

    with Client() as client, client.create(image="python:3.11") as sb:
        sb.files.write("/tmp/x.py", "print(1)")
        assert sb.exec(["python", "/tmp/x.py"]).stdout == b"1\\n"

Errors are :mod:`sandfleet.wire.errors` classes; no httpx exception escapes.
"""

from sandfleet.sdk.client import AsyncClient, AsyncProcess, AsyncSandbox
from sandfleet.sdk.sync import Client, Process, Sandbox

__all__ = ["AsyncClient", "AsyncProcess", "AsyncSandbox", "Client", "Process", "Sandbox"]
