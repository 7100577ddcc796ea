"""Every workflow id and task queue, formatted in one place, and the names derived from them
(safe to call in workflows: pure and deterministic). Workflow types, signals, updates and
queries: ``fleet/contracts/workflows.py``."""

from __future__ import annotations

import hashlib
import re

#: The control-plane worker's task queue.
CONTROL_PLANE_QUEUE = "gpufleet"

#: The one demand loop of a fleet.
DEMAND_WORKFLOW_ID = "demand"


#: The Schedules' workflows (``fleet/schedules.py``): one id each.
SITE_SWEEP_ID = "site-sweep"
CATALOG_REFRESH_ID = "catalog-refresh"
FLEET_SWEEP_ID = "fleet-sweep"
CSR_APPROVER_ID = "csr-approver"


def node_queue(node_name: str) -> str:
    """The task queue a node's agent polls."""
    return f"node/{node_name}"


#: What ``node_name_for`` puts after the site's name: "-" and 8 hex digits.
NODE_NAME_SUFFIX = 9
#: A node's name is also its ``kubernetes.io/hostname`` label value, 63 characters at most, so a
#: site's name leaves room for the suffix.
MAX_SITE_NAME = 63 - NODE_NAME_SUFFIX
#: A site's name: a lowercase DNS label (RFC 1123), as a node's name is made of.
SITE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: Kubernetes' label value syntax (apimachinery ``IsValidLabelValue``), less the empty value.
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


def label_value_problem(value: str) -> str | None:
    """Why the API server would refuse ``value`` as a label value (None: it takes it). The
    fleet writes some config values (a site's GPU, region) as node labels: checked at load,
    they never fail a join after its machine is bought."""
    if len(value) > 63:
        return f"{value!r} is not a Kubernetes label value (at most 63 characters, not {len(value)})"
    if not re.fullmatch(LABEL_VALUE_PATTERN, value):  # fullmatch: ``$`` alone takes a trailing line break
        return (f"{value!r} is not a Kubernetes label value (letters, digits, '-', '_' and '.', "
                "beginning and ending with a letter or digit)")
    return None


def site_name_problem(site: str) -> str | None:
    """Why ``site`` cannot name a site (None: it can): its nodes are named ``<site>-<8 hex>``,
    which must be a lowercase DNS name and fit the hostname label, and the site itself is
    a label value (``LABEL_SITE``, ``LABEL_ZONE``) on each of them."""
    if not re.fullmatch(SITE_NAME_PATTERN, site):
        return (f"{site!r} cannot name nodes: a site name is a lowercase DNS label (a-z, 0-9 and '-', "
                "beginning and ending with a letter or digit)")
    if len(site) > MAX_SITE_NAME:
        return (f"{site!r} cannot name nodes: at most {MAX_SITE_NAME} characters, not {len(site)} (a node is "
                f"named '<site>-<8 hex digits>', and a node's name is its 63-character hostname label)")
    return None


def dns_label(value: str, max_len: int = 63) -> str:
    """A DNS-1035 label (lowercase, ``[a-z0-9-]``, starts with a letter) for ``value``.
    Names cut to fit get a short hash so two long names stay distinct."""
    slug = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-") or "x"
    if not slug[0].isalpha():
        slug = f"m-{slug}"
    if len(slug) > max_len:
        digest = hashlib.sha256(value.encode()).hexdigest()[:8]
        slug = f"{slug[: max_len - 9].rstrip('-')}-{digest}"
    return slug


def kubernetes_name_clash(model: str, other: str) -> str | None:
    """Why ``model`` and ``other`` cannot both be served (None: they can): the Kubernetes
    adapter names a model's Deployments, Services, PodDisruptionBudgets, HTTPRoute and routing
    entry after ``dns_label(model)``, so two names with one label (``Llama-3-8B``,
    ``llama_3_8b``) would write each other's objects."""
    label = dns_label(model)
    if model == other or dns_label(other) != label:
        return None
    return f"{other!r} and {model!r} are one Kubernetes name ({label})"


def serving_name(model: str, site: str) -> str:
    """Deployment, Service and PodDisruptionBudget name for ``model`` at ``site``: ``<model>-<site>``."""
    return dns_label(f"{model}-{site}")


def serving_name_clash(model: str, site: str, other: str, other_site: str) -> str | None:
    """Why ``model`` at ``site`` and ``other`` at ``other_site`` cannot both be served (None: they
    can): ``serving_name`` joins model and site with the '-' that either may hold, so model
    ``a-b`` at site ``c`` and model ``a`` at site ``b-c`` would write one Deployment. Models of
    one label are ``kubernetes_name_clash``'s, not counted again here."""
    name = serving_name(model, site)
    if dns_label(model) == dns_label(other) or serving_name(other, other_site) != name:
        return None
    return f"{other!r} at {other_site} and {model!r} at {site} are one Kubernetes name ({name})"


def model_service_clash(model: str, other: str, other_site: str) -> str | None:
    """Why ``model`` and ``other`` at ``other_site`` cannot both be served (None: they can): the
    model-wide Service is named ``dns_label(model)``, so model ``a-b`` and model ``a`` at site ``b``
    would name one Service, and the per-site one takes it over (``a-b``'s clients reach ``a``)."""
    label = dns_label(model)
    if label == dns_label(other) or serving_name(other, other_site) != label:
        return None
    return f"{other!r} at {other_site} and model {model!r} name one Service ({label})"


def node_name_for(site: str, join_id: str, nonce: str = "") -> str:
    """A node name that a retried or replayed join always computes the same. ``nonce``: the
    join's per-start nonce (its first run id): a later join started with the same id gets a
    new name, so an earlier machine's certificate for the old name never becomes a live
    node's again. Without one (joins started before the nonce), the name of the id alone."""
    seed = f"{join_id}#{nonce}" if nonce else join_id
    return f"{site}-{hashlib.sha256(seed.encode()).hexdigest()[:8]}"


def site_of_node_name(node_name: str) -> str | None:
    """The site a machine the fleet bought was bought at, read back from ``node_name_for``'s
    name; None for a name it did not make (a rack's own names)."""
    site, dash, suffix = node_name.rpartition("-")
    if not site or not dash or not re.fullmatch(r"[0-9a-f]{8}", suffix):
        return None
    return site


def node_workflow_id(node_name: str) -> str:
    """The node's ``Node`` entity (the same string as its queue: one per node)."""
    return f"node/{node_name}"


def join_workflow_id(site: str, request: str) -> str:
    return f"join/{site}/{request}"


def fan_out_join_id(fan_out_id: str, index: int) -> str:
    """The ``index``-th join of a fan-out ``NodeJoin`` (``count`` > 1), its child."""
    return f"{fan_out_id}/{index}"


def account_workflow_id(provider: str, account: str) -> str:
    return f"account/{provider}/{account}"


def site_workflow_id(site: str) -> str:
    return f"site/{site}"


def capacity_workflow_id(request: str) -> str:
    return f"capacity/{request}"


def purchase_workflow_id(seq: int, series: str = "") -> str:
    """The AcquireCapacity a demand purchase runs as (``capacity/<request>``): the loop's ``seq``-th
    in its ``series`` (a loop started before series: none, ``capacity/demand-<seq>``)."""
    return capacity_workflow_id(f"demand-{series}-{seq}" if series else f"demand-{seq}")


def reclaim_workflow_id(node_name: str) -> str:
    return f"reclaim/{node_name}"


def repair_workflow_id(node_name: str, gpu: int) -> str:
    return f"repair/{node_name}/gpu{gpu}"


def repair_node_name(workflow_id: str) -> str | None:
    """``<node>`` of ``repair/<node>/gpu<N>``; None for any other id."""
    node, slash, gpu = workflow_id.removeprefix("repair/").rpartition("/gpu")
    if not workflow_id.startswith("repair/") or not slash or not node or "/" in node or not gpu.isdigit():
        return None
    return node


def evacuation_workflow_id(site: str, n: int) -> str:
    """The Site entity's n-th incident."""
    return f"evacuate/{site}/{n}"


def evacuation_number(site: str, workflow_id: str) -> int | None:
    """``n`` of the Site entity's ``evacuate/<site>/<n>``; None for any other id (a person's
    ``manual-<request>``, another site's)."""
    return _number_after(f"evacuate/{site}/", workflow_id)


def is_evacuation_of(site: str, workflow_id: str) -> bool:
    """Whether ``workflow_id`` names an evacuation of ``site``, the Site entity's or a person's (also
    what an evacuation's drain marks its cordons with, ``fleet.cluster.ANNOTATION_CORDONED_BY``)."""
    prefix = f"evacuate/{site}/"
    return workflow_id.startswith(prefix) and 0 < len(workflow_id) - len(prefix) <= 100 and "/" not in \
        workflow_id[len(prefix):]


def fill_workflow_id(site: str, n: int) -> str:
    """The Site entity's n-th fill: the AcquireCapacity that brings the site to its min."""
    return capacity_workflow_id(f"site-{site}-{n}")


def fill_number_of(site: str, workflow_id: str) -> int | None:
    """``n`` of the Site entity's ``capacity/site-<site>-<n>``; None for any other id (another
    site's fill, a purchase, a person's request)."""
    return _number_after(capacity_workflow_id(f"site-{site}-"), workflow_id)


def _number_after(prefix: str, workflow_id: str) -> int | None:
    """The number (1 or more) that ``workflow_id`` is ``prefix`` followed by; None for an id that is
    not (another series, another site's)."""
    found = re.fullmatch(rf"{re.escape(prefix)}([1-9][0-9]*)", workflow_id)
    return int(found.group(1)) if found else None


def manual_evacuation_id(site: str, request_id: str) -> str:
    """A SiteEvacuation started by a person: its own series beside the Site entity's
    ``evacuate/<site>/<n>``, so the entity's next incident never collides with it."""
    return f"evacuate/{site}/manual-{request_id}"


def advisor_workflow_id(since: str) -> str:
    """The Advisor for a period (a Schedule's runs: ``advisor/<since>-<time>``)."""
    return f"advisor/{since}"


def routing_workflow_id(model: str) -> str:
    """The model's ``Routing`` entity: the one writer of its routes."""
    return f"routing/{model}"


def rollout_id(model: str, version: str) -> str:
    return f"rollout/{model}/{version}"
