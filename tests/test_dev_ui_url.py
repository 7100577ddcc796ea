"""The Temporal UI link of a workflow a command started is the stack's own UI (issue 36): `gpufleet
dev --ui-port 9000` tells its children (``GPUFLEET_UI_URL``) and prints what other shells export;
`--temporal cluster` runs no UI, so no link is printed at all rather than one that leads nowhere.
(That the running stack does both: tests/test_dev_stack.py.)"""

from __future__ import annotations

import pytest

from cli.dev import DevPorts, ui_export_line, ui_url
from cli.requests import announce, ui_link
from fleet.settings import Settings

STACK = Settings(address="127.0.0.1:7233")


def test_the_stack_names_its_own_ui_and_other_shells_are_told_when_they_cannot_derive_it() -> None:
    default = ui_url("dev-server", DevPorts.derive(7233))
    assert default == "http://127.0.0.1:8233"
    assert ui_export_line(STACK, default) is None, "port + 1000: every shell derives it from the address"
    moved = ui_url("dev-server", DevPorts.derive(7233, ui=9000))
    assert moved == "http://127.0.0.1:9000"
    assert ui_export_line(STACK, moved).split() == ["other", "shells:", "export", "GPUFLEET_UI_URL=http://127.0.0.1:9000"]
    assert ui_url("cluster", DevPorts.derive(7233)) == "none"
    assert "export GPUFLEET_UI_URL=none" in ui_export_line(STACK, "none")


def test_the_link_follows_gpufleet_ui_url_and_none_means_no_link(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("GPUFLEET_UI_URL", "http://127.0.0.1:9000")
    assert ui_link(STACK, "join/site-a/x") == "http://127.0.0.1:9000/namespaces/default/workflows/join%2Fsite-a%2Fx"
    monkeypatch.setenv("GPUFLEET_UI_URL", "none")
    assert ui_link(STACK, "join/site-a/x") is None
    announce(STACK, "join/site-a/x")
    assert capsys.readouterr().out.splitlines() == ["started join/site-a/x"]
    monkeypatch.setenv("GPUFLEET_UI_URL", "")  # set but empty: as unset, derived from the address
    assert ui_link(STACK, "x") == "http://127.0.0.1:8233/namespaces/default/workflows/x"
