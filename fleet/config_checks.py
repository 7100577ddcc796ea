"""The fleet config's cross-checks (``sites.yaml``): problems between fields and entries
(duplicate names, unknown references, a site's account of another provider, a model's
sites), read from the raw mapping, so one ``gpufleet config check`` names every problem
together with the field errors of ``fleet.config`` (the schema), which calls these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from fleet.models import JOIN_OPTIONS, MAX_REQUEST_COUNT, MAX_SITE_NODES, PROVIDERS
from fleet.naming import kubernetes_name_clash, model_service_clash, serving_name_clash
from fleet.replacement import may_move


class _Place(NamedTuple):
    """What the compliance rule (``fleet.replacement.may_move``) reads of a raw site."""

    name: str
    geography: str | None
    compliance: bool


def _entries(raw: dict[str, Any], key: str) -> list[tuple[int, dict[str, Any]]]:
    value = raw.get(key)
    return [(i, item) for i, item in enumerate(value) if isinstance(item, dict)] if isinstance(value, list) else []


def _named_entries(raw: dict[str, Any], key: str, kind: str, problems: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each entry under ``key`` with where it stands (``sites[2] (name)``), a name seen before
    already added to ``problems`` as a duplicate ``kind``."""
    seen: set[str] = set()
    for i, entry in _entries(raw, key):
        name = entry.get("name")
        where = f"{key}[{i}]" + (f" ({name})" if name else "")
        if isinstance(name, str):
            if name in seen:
                problems.append(f"{where}.name: duplicate {kind}")
            seen.add(name)
        yield where, entry


def cross_check(raw: dict[str, Any]) -> list[str]:
    """Problems between fields and entries, on the raw mapping: an entry whose own fields
    are wrong still takes part (its bad values are skipped, the field errors name them)."""
    problems: list[str] = []
    real = raw.get("mode") == "real"
    accounts: dict[str, Any] = {}
    account_entries = list(_named_entries(raw, "accounts", "account", problems))
    for where, account in account_entries:
        if isinstance(account.get("name"), str):
            accounts.setdefault(account["name"], account.get("provider"))
        if real and account.get("credentials") is None:
            problems.append(f"{where}.credentials: missing credentials reference")
    for where, site in _named_entries(raw, "sites", "site", problems):
        low, high = site.get("min_nodes", 0), site.get("max_nodes")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"{where}.min_nodes: min_nodes ({low}) is greater than max_nodes ({high})")
        if isinstance(low, int) and low > MAX_REQUEST_COUNT:
            # Checked here, not in the model: workflows decode a Site from recorded activity results.
            problems.append(f"{where}.min_nodes: {low} is more than {MAX_REQUEST_COUNT}, the most one capacity "
                            f"request buys: the site's entity fills its min with one request, which would be "
                            f"refused every time")
        if isinstance(high, (int, float)) and not isinstance(high, bool) and high > MAX_SITE_NODES:
            # Here, not in the model, as min_nodes's. A float too: the model takes 1.0e+17 as an int.
            problems.append(f"{where}.max_nodes: {high} is more than {MAX_SITE_NODES}, the most nodes the fleet's "
                            f"one Kubernetes cluster is built for (every site's nodes join it); the site's entity "
                            f"carries its max over continue-as-new, where a number past 2**53 is refused")
        if site.get("compliance") is True and not site.get("geography"):
            problems.append(f"{where}.compliance: a compliance site needs a geography")
        account = site.get("account")
        if isinstance(account, str):
            if account not in accounts:
                problems.append(f"{where}.account: unknown account reference {account!r}")
            elif site.get("provider") in PROVIDERS and accounts[account] in PROVIDERS \
                    and accounts[account] != site.get("provider"):
                problems.append(f"{where}.account: account {account!r} is a {accounts[account]} account, "
                                f"site is {site.get('provider')}")
    if real:
        problems += _missing_join_options(account_entries, [site for _, site in _entries(raw, "sites")])
    return problems + _shared_node_secrets(raw) + _check_models(raw)


#: The references a GPU node is given (its serving pods name the Secret): a hostile node reads them.
NODE_CREDENTIALS = "pull_credentials"


def _secret_references(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(where, ``namespace/name``) of every ``secret:`` reference in the raw mapping."""
    if isinstance(value, dict):
        secret = value.get("secret")
        if isinstance(secret, str):  # a credentials reference, wherever the config holds one
            yield where, secret.partition("#")[0]
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                yield from _secret_references(item, f"{where}.{key}".lstrip("."))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            name = item.get("name") if isinstance(item, dict) else None
            yield from _secret_references(item, f"{where}[{i}]" + (f" ({name})" if isinstance(name, str) else ""))


def _shared_node_secrets(raw: dict[str, Any]) -> list[str]:
    """A node's key in a Secret that also holds a key of the control plane's: a kubelet may read
    the whole of every Secret its pods name, not the one key, so the node would read that too."""
    references = list(_secret_references(raw))
    others = {secret: where for where, secret in references if not where.endswith(f".{NODE_CREDENTIALS}")}
    return [f"{where}: the Secret {secret} also holds {others[secret]}, which a node must never read (a node "
            f"may read the whole of every Secret its pods name): give the node's key a Secret of its own"
            for where, secret in references if where.endswith(f".{NODE_CREDENTIALS}") and secret in others]


def _missing_join_options(accounts: list[tuple[str, dict[str, Any]]], sites: list[dict[str, Any]]) -> list[str]:
    """The options an account's provider joins no machine without (``fleet.models.JOIN_OPTIONS``),
    where a site of the account can join (its ``max_nodes`` is not 0): each of its joins would
    be refused after the worker started, and a site with ``min_nodes`` keeps failing its fills."""
    problems = []
    for where, account in accounts:
        provider = account.get("provider")
        needed = JOIN_OPTIONS.get(provider, {}) if isinstance(provider, str) else {}
        joining = [str(site.get("name")) for site in sites
                   if site.get("account") == account.get("name") and site.get("max_nodes") != 0]
        options = account.get("options") or {}
        if not needed or not joining or not isinstance(options, dict):
            continue  # options of another type: the field error names them
        for option, purpose in needed.items():
            if not options.get(option):
                problems.append(f"{where}.options.{option}: missing; {provider} needs {purpose}: "
                                f"without it every join at {', '.join(joining)} fails")
    return problems


def _check_models(raw: dict[str, Any]) -> list[str]:
    """Every model names known sites; standby sites only where the mode has them, and only
    inside a compliance primary's geography (fleet.replacement); no two models share one
    Kubernetes name, nor two models at their sites one serving name."""
    models = raw.get("models")
    if not isinstance(models, dict):
        return []
    sites = {s.get("name"): s for _, s in _entries(raw, "sites") if isinstance(s.get("name"), str)}
    problems: list[str] = []
    for model, policy in models.items():
        if not isinstance(policy, dict):
            continue
        where = f"models.{model}"
        primaries = policy.get("sites") if isinstance(policy.get("sites"), list) else []
        standby = policy.get("standby_sites") if isinstance(policy.get("standby_sites"), list) else []
        for field, names in (("sites", primaries), ("standby_sites", standby)):
            for name in names:
                if isinstance(name, str) and name not in sites:
                    problems.append(f"{where}.{field}: unknown site {name!r}")
        both = set(map(str, primaries)) & set(map(str, standby))
        if both:
            problems.append(f"{where}.standby_sites: {', '.join(sorted(both))} also primary")
        mode = policy.get("mode", "active-active")
        if mode == "active-active" and standby:
            problems.append(f"{where}.standby_sites: active-active has no standby sites (list them in sites)")
        if mode in ("active-passive", "burst") and (not primaries or not standby):
            problems.append(f"{where}.mode: {mode} needs sites (primaries) and standby_sites")
        first = sites.get(primaries[0]) if primaries and isinstance(primaries[0], str) else None
        if first is not None and first.get("compliance") is True:
            anchor = _Place(first["name"], first.get("geography"), True)
            for name in [*primaries[1:], *standby]:
                other = sites.get(name)
                if other is not None and not may_move(anchor, _Place(name, other.get("geography"),
                                                                     bool(other.get("compliance")))):
                    problems.append(f"{where}: {name} is outside compliance site {first['name']}'s geography "
                                    f"{first.get('geography')!r}")
    names = [str(model) for model in models]
    for i, model in enumerate(names):
        problems += [f"models: {clash}" for other in names[:i] if (clash := kubernetes_name_clash(model, other))]
    return problems + _serving_name_clashes(models)


def _serving_name_clashes(models: dict[Any, Any]) -> list[str]:
    """Two models whose sites give one serving name (``a-b`` at ``c``, ``a`` at ``b-c``): the
    Kubernetes adapter would write one Deployment, Service and PodDisruptionBudget for both; or a
    model's site whose serving name is another model's own (``a`` at ``b``, ``a-b``): one Service."""
    placed: list[tuple[str, str, str]] = []  # (field, model, site), in the file's order
    for model, policy in models.items():
        if not isinstance(policy, dict):
            continue
        for field in ("sites", "standby_sites"):
            names = policy.get(field)
            placed += [(f"models.{model}.{field}", str(model), site)
                       for site in (names if isinstance(names, list) else []) if isinstance(site, str)]
    problems = []
    for i, (field, model, site) in enumerate(placed):
        problems += [f"{field}: {clash}" for _, other, other_site in placed[:i]
                     if (clash := serving_name_clash(model, site, other, other_site))]
    for model in models:
        problems += [f"{field}: {clash}" for field, other, site in placed
                     if (clash := model_service_clash(str(model), other, site))]
    return problems

