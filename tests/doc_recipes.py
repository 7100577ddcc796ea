"""The install pages' certificate recipes, run as a reader copies them: a fenced shell block of a
page, its ``openssl`` lines run by bash, and the Secrets its ``kubectl create secret`` lines would
make, read from those lines (which file goes to which key), so a test serves the very files the
page makes, under the keys the page gives them."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shell_block(page: Path, containing: str) -> list[str]:
    """The lines of ``page``'s one fenced block that holds ``containing``, each continued line
    (a trailing backslash) joined to the next, as the shell reads them."""
    blocks = re.findall(r"^ *```(?:bash|sh)\n(.*?)^ *```", page.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if containing in b]
    return block.replace("\\\n", " ").splitlines()


def run_openssl_lines(lines: list[str], folder: Path) -> None:
    """Run, in ``folder``, the lines that call ``openssl`` and the shell functions the block
    defines (their definitions too); ``kubectl`` and ``gpufleet`` lines are the caller's to read,
    not to run here."""
    functions = {m.group(1) for line in lines if (m := re.match(r"\s*([\w-]+)\(\)", line))}
    script, depth = [], 0
    for line in lines:
        name = line.split()[0].split("(")[0] if line.split() else ""
        if depth or name in {"openssl", *functions}:
            script.append(line)
            depth += line.count("{") - line.count("}")  # inside a function's body
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(script)], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{done.stderr}\n--- ran:\n" + "\n".join(script)


def secrets_as_written(text: str) -> dict[str, dict[str, str]]:
    """Each Secret that ``text``'s ``kubectl ... create secret generic|tls NAME ...`` commands
    make, in a shell line or an inline code span: its name, then each key and its file."""
    text = text.replace("\\\n", " ")
    commands = re.findall(r"`(kubectl [^`]*create secret [^`]*)`", text)
    commands += re.findall(r"^\s*(kubectl [^`\n]*create secret [^\n]*)$", text, re.M)
    return dict(secret_commands(commands))


def secrets_in_order(lines: list[str]) -> list[tuple[str, dict[str, str]]]:
    """The Secrets a shell block's ``kubectl ... create secret`` lines make, in order (one Secret
    written again, as a rotation does, is there each time)."""
    return secret_commands([line for line in lines if re.match(r"\s*kubectl .*create secret ", line)])


def secret_commands(commands: list[str]) -> list[tuple[str, dict[str, str]]]:
    """(name, key → file) of each ``kubectl ... create secret generic|tls NAME ...`` command."""
    made: list[tuple[str, dict[str, str]]] = []
    for command in commands:
        words = shlex.split(command.replace("\n", " "), comments=True)
        at = words.index("secret")
        if words[at + 1:at + 2] not in (["generic"], ["tls"]):
            continue
        keys: dict[str, str] = {}
        for word in words[at + 3:]:
            option, _, value = word.partition("=")
            if option == "--from-file":
                key, _, source = value.rpartition("=")
                keys[key or Path(source).name] = source
            elif option in ("--cert", "--key"):
                keys["tls.crt" if option == "--cert" else "tls.key"] = value
        made.append((words[at + 2], keys))
    return made


def secret_folder(folder: Path, keys: dict[str, str], made_in: Path) -> Path:
    """``folder`` holding the Secret's keys as files (a mounted Secret), each from ``made_in``."""
    folder.mkdir(parents=True, exist_ok=True)
    for key, source in keys.items():
        (folder / key).write_bytes((made_in / source).read_bytes())
    return folder
