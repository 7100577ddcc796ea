"""The node gateway (``gpufleet node-gateway``, ``python -m workers.node_gateway``): the only
door from a GPU node to Temporal. Split by job:

- ``node_identity``: what a node holds and shows: its certificate's subject, its key and CSR
  (made on the node), and where the gateway is (``GatewayAccess``). The only part the node
  agent imports: the code that ships to third-party machines carries none of the CA's
  (an import-linter contract in pyproject.toml keeps it so).
- ``authorization``: which calls a node may make, each request rebuilt from what the policy
  allows.
- ``task_tokens``: each task token handed to a node sealed for it with the key every replica
  holds, and opened again only for that node.
- ``liveness``: whether a certificate's node is still live (its identity record, bound key,
  and Node entity or NodeJoin), cached per (node, key).
- ``proxy``: the gRPC server: per-node limits, forwarding over the control plane's own
  connection, the gateway's metrics.
- ``fleet_budget``: what every node together may send upstream, shared max-min fairly among
  the nodes calling.
- ``pki``: the dev stack's and the tests' CA and signer (production uses the cluster CA's).
- ``node_log``: the warnings a node's calls cause (refusals, limits, failed liveness checks),
  at most one per node and reason a minute and then how many more: a node decides its call
  rate, not how much the gateway writes to the log every component shares.

This file imports none of them, so importing one part loads only what it needs.

GPU nodes run at third parties; one of them may be compromised. A node agent
therefore holds no Temporal credentials: it dials this gateway with mutual TLS,
presenting its node client certificate (``CN=system:node:<name>``, group
``system:nodes``, the same shape as a kubelet's), and the gateway forwards, over
the control plane's own connection (the standard ``TEMPORAL_*`` settings: mTLS
or API key), only what a node agent needs:

- ``PollActivityTaskQueue`` on ``node/<its own name>``;
- ``RespondActivityTask{Completed,Failed,Canceled}`` and
  ``RecordActivityTaskHeartbeat`` with task tokens the gateway (any replica,
  before or after a restart) delivered to that same node;
- the read-only calls the SDK's worker makes at start-up and its
  ``ShutdownWorker`` (see ``authorization._START_UP``).

Everything else is ``PERMISSION_DENIED``, logged with the node's name (``node_log``; ``RecordWorkerHeartbeat``
too: nothing reads a node's worker heartbeats, and they could fill the server's worker list).
Each forwarded request is rebuilt from only the fields the policy allows (unknown fields,
deployment and versioning options, embedded worker heartbeats, heartbeat and cancellation
details dropped; a failure rebuilt as message, type, ``non_retryable``, a bounded stack trace
and one cause, without payloads the workflow's SDK would decode; a result as one ``json/plain``
payload with no other metadata, any other form replaced by one nobody decodes), with the caller's
``identity`` replaced by ``node:<name>``, so histories name the authenticated node.

Every call also checks the certificate (its expiry, so an open connection stops working
when it expires) and that the node is live (``node_liveness``): the certificate's key is
one the cluster's signer bound to the node at its join or a renewal, and its identity
record and Node entity (or its NodeJoin) exist. Certificates cannot be revoked; every
retire path deletes those records, so a retired node's certificate stops working within
the verdict cache's ``--live-ttl`` (1 s), and a Node object its kubelet re-creates, or a
certificate for its name from any other signer, opens nothing.

Per node, calls, polls, connections and request sizes are bounded (see ``proxy``): a call
over a bound is held without going upstream, and a node holding too many is refused at once,
so one node cannot take the frontend's poll budget or the gateway's memory from the others;
and every node's calls together take from one budget (``fleet_budget``), so many nodes cannot
take the frontend's request rate either.

The gateway keeps no state a restart or another replica would miss: the task token a
node is handed is sealed for that node with the key every replica reads from one Secret
(``task_tokens``), so its heartbeats and answers go through any replica, before or after
a restart (each restart used to leave a node's watch unheard until its heartbeat timeout).

PKI helpers (dev stack, tests): ``pki.Pki`` makes a CA and the gateway's server
certificate; ``node_identity.node_key_and_csr`` runs on the node (the key never leaves
it); ``Pki.sign_node_csr`` is the signer (the cluster's CSR approver in production).
"""
