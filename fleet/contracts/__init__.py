"""The seams between processes, declared once: what a workflow schedules (``activities``);
every workflow type, signal, update and query by the name Temporal routes by (``workflows``);
and the operator updates the HTTP relay may carry to which entity (``entity_update``).
Workflow ids and task queues are formatted in ``fleet/naming.py``. Nothing outside this
package names any of them with a bare string (``tests/test_registration.py``)."""
