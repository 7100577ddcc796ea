"""The own-rack seed server: each machine's NoCloud seed, served once and only to that machine.

A rack machine has no provider metadata service, so its bootstrap document (the join
token in a kubeadm JoinConfiguration) reaches it over the provisioning network. The own-dc
adapter writes the seed into ``options.seed_dir`` (``<machine>/user-data``, ``meta-data``
and ``nonce``, all 0600) before it powers the machine on, a fresh ``nonce`` each time. This
server hands it out:

* ``GET /ipxe``: the machine's iPXE script (``options.ipxe_template`` with ``$seed_url``
  filled in), for the machine whose provisioning address (``machines[].provision_address``,
  its static DHCP lease) made the request, and only while its seed is waiting. The seed
  URL carries the nonce: ``<url>/seed/<nonce>/``, which cloud-init gets on the kernel
  command line (``ds=nocloud-net;s=<seed url>``).
* ``GET /seed/<nonce>/meta-data`` and ``/user-data``: only to the address of the machine
  whose seed carries that nonce. ``user-data`` is taken, not read: renamed away (one
  rename wins, even against a second server on the same directory), read and deleted,
  and the nonce with it, so a second fetch, from anywhere, finds nothing.

Everything else answers 404 with no body, whether the seed is gone, the nonce is wrong or
the requester is another address: a prober learns nothing. The log names machines and
requester addresses, never a nonce or a document.

Run it where the rack machines reach it directly (their source address must arrive
unchanged) and where it sees the worker's ``seed_dir``: ``python -m providers.own_dc_seed
--config sites.yaml --account own-racks --listen 0.0.0.0:8470 --url http://10.0.0.1:8470``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from string import Template
from typing import Annotated

import typer

log = logging.getLogger("gpufleet.own_dc_seed")

#: The seed files of one machine (``<seed_dir>/<machine>/``).
SEED_FILES = ("user-data", "meta-data", "nonce")


def read_nonce(folder: Path) -> str:
    try:
        return (folder / "nonce").read_text().strip()
    except FileNotFoundError:
        return ""


def take_user_data(folder: Path) -> str | None:
    """The machine's user data, removed from the directory: the first caller gets it, any
    later (or concurrent) one ``None``."""
    taken = folder / f".taken.{secrets.token_hex(8)}"
    try:
        os.rename(folder / "user-data", taken)
    except FileNotFoundError:
        return None
    try:
        text = taken.read_text()
    finally:
        taken.unlink()
        with contextlib.suppress(FileNotFoundError):
            (folder / "nonce").unlink()
    return text


class SeedServer:
    """Serves the seeds under ``seed_dir`` to the machines of ``addresses`` (machine -> its
    provisioning address)."""

    def __init__(self, seed_dir: Path, addresses: dict[str, str], url: str,
                 ipxe_template: str | None = None, listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.seed_dir = Path(seed_dir)
        self.machines = {address: machine for machine, address in addresses.items() if address}
        self.url = url.rstrip("/")
        self.ipxe_template = ipxe_template
        self._httpd = ThreadingHTTPServer(listen, self._handler())
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> "SeedServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="own-dc-seed", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def serve(self, requester: str, path: str) -> tuple[int, str]:
        """(status, body) for a GET of ``path`` from address ``requester``."""
        machine = self.machines.get(requester)
        if machine is None:
            log.warning("seed request from %s, which is no machine's provisioning address", requester)
            return 404, ""
        folder = self.seed_dir / machine
        nonce = read_nonce(folder)
        if path == "/ipxe":
            if not nonce or not self.ipxe_template or not (folder / "user-data").exists():
                return 404, ""
            return 200, Template(self.ipxe_template).safe_substitute(seed_url=f"{self.url}/seed/{nonce}/")
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "seed" or parts[2] not in ("meta-data", "user-data"):
            return 404, ""
        if not nonce or not hmac.compare_digest(parts[1], nonce):
            log.warning("seed request from %s (machine %s) with a stale or wrong seed URL", requester, machine)
            return 404, ""
        if parts[2] == "meta-data":
            try:
                return 200, (folder / "meta-data").read_text()
            except FileNotFoundError:
                return 404, ""
        text = take_user_data(folder)
        if text is None:
            return 404, ""
        log.info("seed of machine %s taken by %s", machine, requester)
        return 200, text

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the default line carries the path, and so the nonce
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                status, body = server.serve(self.client_address[0], self.path.split("?", 1)[0])
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

        return Handler


def server_for_account(config_path: str, account_name: str, url: str,
                       listen: tuple[str, int]) -> SeedServer:
    from fleet.config import load_config

    config = load_config(config_path)
    account = next((a for a in config.accounts if a.name == account_name), None)
    if account is None or account.provider != "own-dc":
        raise SystemExit(f"no own-dc account {account_name!r} in {config_path}")
    options = account.options
    if not options.get("seed_dir"):
        raise SystemExit(f"account {account_name}: options.seed_dir is not set")
    addresses = {str(m["name"]): str(m.get("provision_address") or "") for m in options.get("machines") or []}
    template = Path(options["ipxe_template"]).expanduser().read_text() if options.get("ipxe_template") else None
    return SeedServer(Path(options["seed_dir"]).expanduser(), addresses, url, template, listen)


def cli(
    config: Annotated[str, typer.Option(help="the fleet config (sites.yaml)")],
    account: Annotated[str, typer.Option(help="the own-dc account whose machines it serves")],
    url: Annotated[str, typer.Option(help="the URL the machines reach this server at")],
    listen: Annotated[str, typer.Option(help="host:port to listen on")] = "0.0.0.0:8470",
) -> None:
    """Serve own-rack NoCloud seeds, once each, to their machine only."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s own-dc-seed %(levelname)s %(message)s")
    host, _, port = listen.rpartition(":")
    server = server_for_account(config, account, url, (host or "0.0.0.0", int(port)))
    log.info("serving seeds of %d machines on %s", len(server.machines), listen)
    try:
        server._httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    typer.run(cli)
