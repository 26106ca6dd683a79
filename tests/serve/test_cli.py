"""``deepseek-flash serve`` as a process, the way its systemd unit runs it: ``READY=1`` once the port
answers (the port in ``STATUS``), the routes, then on SIGTERM ``STOPPING=1`` and exit status 0."""
import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from serve_helpers import greedy


def test_the_serve_verb_notifies_ready_serves_and_stops_on_sigterm(tiny_checkpoint, tiny_reference, tmp_path):
    from deepseek_flash.store import pack

    store = pack(tiny_checkpoint, tmp_path / "tiny-cli")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "OMP_NUM_THREADS": "1",
           "DEEPSEEK_FLASH_RUNTIME_DIR": str(tmp_path / "run"),
           "DEEPSEEK_FLASH_SOCKET": str(tmp_path / "no-daemon.sock")}
    proc = subprocess.Popen([sys.executable, "-m", "deepseek_flash.cli", "serve", str(store), "--port", "0",
                             "--device", "cpu", "--max-batch", "2", "--torch-threads", "1", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        fields = dict(line.split("=", 1) for line in notify.recv(4096).decode().splitlines())
        assert fields["READY"] == "1", fields
        port = re.fullmatch(r"serving tiny-cli on 127\.0\.0\.1:(\d+)", fields["STATUS"])[1]
        base = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["tiny-cli"]
        want = greedy(tiny_reference, [5, 6, 7], 4)
        want = want[: want.index(256)] if 256 in want else want                 # eos ends it
        answer = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny-cli", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).json()
        assert answer["usage"]["completion_tokens"] == len(want)
        proc.send_signal(signal.SIGTERM)
        assert notify.recv(4096) == b"STOPPING=1"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
        notify.close()
    assert "Traceback" not in output, output


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_every_accepted_connection_has_nagle_off(loop):
    """The listening socket names IPPROTO_TCP, so that asyncio sets TCP_NODELAY on each connection
    it accepts (uvloop, uvicorn's loop when installed, does for any TCP socket): a streamed token
    written after the headers goes out at once instead of waiting for the client's delayed ACK
    (~40 ms). A socket made without it does not get it from asyncio."""
    import asyncio

    from deepseek_flash.serve.cli import listen

    async def accepted_nodelay(sock):
        seen = asyncio.get_running_loop().create_future()

        def on_connection(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()
        server = await asyncio.start_server(on_connection, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        try:
            return await asyncio.wait_for(seen, 20)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    def run(coro):
        if loop == "asyncio":
            return asyncio.run(coro)
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)

    assert run(accepted_nodelay(listen("127.0.0.1", 0))) != 0
    if loop == "asyncio":
        plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        plain.bind(("127.0.0.1", 0))
        plain.listen(8)
        assert run(accepted_nodelay(plain)) == 0
