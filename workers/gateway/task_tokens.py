"""Task tokens bound to the node they were delivered to, by a key every replica holds.

A node is handed not Temporal's task token but an envelope: a version byte, an HMAC-SHA256 of
the node's name, the task's activity type and the token under the gateway's key, the activity
type (a length byte and its name) and the token. The type says which bound the task's result
takes (``authorization.RESULT_LIMITS``): the gateway learns it from the poll that delivered the
task, and the node cannot change it without breaking the MAC. An envelope of the first version
(``VERSION``: no type; sealed by a replica from before the type was sealed, for a task still in
flight after an upgrade) opens with no type: its result takes the gateway's general bound. Each call that carries one
(a heartbeat, a completion, a failure, a cancellation) is forwarded with the token inside only
when the envelope's MAC is right for the calling node (its name from its certificate) under the
current key or the previous one. The key lives in a Secret every replica mounts
(``gpufleet-node-gateway-token-key``, read from ``GPUFLEET_GATEWAY_TOKEN_KEYS`` at start), so any
replica, before or after a restart, takes a node's answer to its own task: a gateway restart (every
control-plane upgrade rolls it) or a node reconnecting to the other replica used to have that
answer refused until the activity's heartbeat timeout (up to 10 minutes of a node's watch unwatched).

What the table of delivered tokens each replica kept in memory gave, and where it is now:

- bound to the node: the node's name is under the MAC; another node's envelope, an altered one,
  one made with a key this gateway does not hold, or a bare token is refused (PERMISSION_DENIED).
- a retired identity refused: every call still checks the node's liveness first, and a node's
  name is never reused (it carries its join's nonce), so a retired node's envelopes open nothing.
- bounded memory: nothing is kept per token.
- no second answer: Temporal refuses an answer to a task already answered, and the node's call
  rate (``proxy.CALLS_PER_SECOND``) bounds how often it may ask.

The node agent's SDK keeps the envelope as opaque bytes (sdk-core's ``TaskToken``, only ever
compared and sent back; the version byte keeps it clear of core's ``local_act_`` prefix). The
key never leaves this module's objects: no log line, error or ``repr`` shows it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fleet.settings import NodeGatewayEnv, SettingsError

#: The key files in ``GPUFLEET_GATEWAY_TOKEN_KEYS`` (the Secret's keys): ``current`` signs every
#: envelope and is accepted; ``previous``, when there, is accepted too (a key rotation).
CURRENT, PREVIOUS = "current", "previous"
#: A key holds at least this many bytes (``openssl rand -hex 32`` writes 64).
MIN_KEY_BYTES = 32
VERSION = b"\x01"
#: An envelope that names its task's activity type (what every replica seals now).
KIND_VERSION = b"\x02"
MAC_BYTES = hashlib.sha256().digest_size
#: What the MAC is of, before the node's name: no other use of the key could make the same bytes.
_PURPOSE = b"gpufleet node gateway task token\x00"
_KIND_PURPOSE = b"gpufleet node gateway typed task token\x00"
#: An activity type name longer than this is sealed as none (no node activity's is near it).
MAX_KIND_BYTES = 255


@dataclass(frozen=True, repr=False)
class TokenKeys:
    """The gateway's task-token keys: ``current`` signs, ``previous`` (or None) is accepted too."""

    current: bytes
    previous: bytes | None = None

    def __repr__(self) -> str:
        return f"TokenKeys(current, {'previous' if self.previous else 'no previous'})"

    @classmethod
    def load(cls, directory: Path | None) -> "TokenKeys":
        """The keys in ``directory`` (the Secret mounted), or a ``SettingsError`` naming the
        variable, the file and what is wrong with it, never what it holds."""
        variable = NodeGatewayEnv.variable("token_keys")
        if directory is None:
            raise SettingsError(f"{variable}: required: the directory of the Secret "
                                f"gpufleet-node-gateway-token-key (its file {CURRENT!r}, and {PREVIOUS!r} "
                                f"while rotating)")
        current = _read_key(directory / CURRENT, variable, required=True)
        return cls(current, _read_key(directory / PREVIOUS, variable, required=False))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "TokenKeys":
        """The keys where ``GPUFLEET_GATEWAY_TOKEN_KEYS`` says (``environ``, default the process's)."""
        return cls.load(NodeGatewayEnv.from_env(environ).token_keys)


def _read_key(path: Path, variable: str, required: bool) -> bytes | None:
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        key = b""
    except OSError as error:
        raise SettingsError(f"{variable}: cannot read {path}: {error.strerror}") from None
    if not key:
        if required:
            raise SettingsError(f"{variable}: no key in {path} (make one: openssl rand -hex -out {path.name} 32)")
        return None
    if len(key) < MIN_KEY_BYTES:
        raise SettingsError(f"{variable}: the key in {path} is {len(key)} bytes; at least {MIN_KEY_BYTES} "
                            f"(openssl rand -hex 32)")
    return key


class TaskTokens:
    """Seals the tokens delivered to a node and opens the envelopes it sends back."""

    def __init__(self, keys: TokenKeys) -> None:
        self._keys = tuple((name, k) for name, k in ((CURRENT, keys.current), (PREVIOUS, keys.previous)) if k)
        #: Envelopes opened since start, by the key that opened them (``CURRENT``, ``PREVIOUS``):
        #: once the previous key's count stops rising, no node holds a token bound with it and a
        #: rotation may drop it (``gpufleet_gateway_task_tokens_opened_total``).
        self.opened: Counter[str] = Counter()

    @staticmethod
    def _mac(key: bytes, node: str, token: bytes) -> bytes:
        return hmac.new(key, _PURPOSE + node.encode() + b"\x00" + token, hashlib.sha256).digest()

    @staticmethod
    def _kind_mac(key: bytes, node: str, kind: bytes, token: bytes) -> bytes:
        return hmac.new(key, _KIND_PURPOSE + node.encode() + b"\x00" + bytes([len(kind)]) + kind + token,
                        hashlib.sha256).digest()

    def seal(self, node: str, token: bytes, kind: str = "") -> bytes:
        """The envelope of Temporal's ``token`` for ``node`` and its task's activity type
        ``kind``, under the current key."""
        named = kind.encode()
        if len(named) > MAX_KIND_BYTES:
            named = b""
        return KIND_VERSION + self._kind_mac(self._keys[0][1], node, named, token) + bytes([len(named)]) + named + token

    def open(self, node: str, envelope: bytes) -> bytes | None:
        """Temporal's token inside ``envelope`` when it was sealed for ``node`` under the current
        or the previous key; None for anything else."""
        opened = self.open_task(node, envelope)
        return opened[0] if opened is not None else None

    def open_task(self, node: str, envelope: bytes) -> tuple[bytes, str] | None:
        """Temporal's token inside ``envelope`` and the activity type sealed with it ("" for none),
        when it was sealed for ``node`` under the current or the previous key; None for anything else."""
        if len(envelope) <= 1 + MAC_BYTES:
            return None
        version, mac = envelope[:1], envelope[1:1 + MAC_BYTES]
        if version == KIND_VERSION:
            size = envelope[1 + MAC_BYTES]
            start = 2 + MAC_BYTES + size
            if len(envelope) <= start:
                return None
            named, token = envelope[2 + MAC_BYTES:start], envelope[start:]
            macs = ((name, self._kind_mac(key, node, named, token)) for name, key in self._keys)
        elif version == VERSION:
            named, token = b"", envelope[1 + MAC_BYTES:]
            macs = ((name, self._mac(key, node, token)) for name, key in self._keys)
        else:
            return None
        for name, expected in macs:
            if hmac.compare_digest(mac, expected):
                self.opened[name] += 1
                return token, named.decode(errors="replace")
        return None
